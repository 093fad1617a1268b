"""Through a real LiteLLM proxy process (DB-less) between the shim and the simulator: usage and cost match
the simulator's truth on both routes, and LiteLLM's 529-as-500 is retried by the shim.

The venv's own `litellm` proxy is used (the lock pins litellm[proxy]); $EVALPLANE_LITELLM names another. Under
CI=true a proxy that cannot serve fails the module; elsewhere it is skipped with the reason.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import sys
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest
from shimtest import sim_stats

from contract.models import Usage
from contract.pricing import price
from plumbing.services import Service, ServiceFailed
from simulator import SimulatorConfig
from simulator.testing import running_simulator
from tests.conftest import free_port

MODEL = "claude-sonnet-4-5"
FAULTY = f"anthropic/{MODEL}"  # a second model group on the faulty simulator; priced as MODEL by the shim
SIM_KEY = "sk-sim-" + secrets.token_hex(8)
SYSTEM = [{"type": "text", "text": "You are a careful software engineer. " * 40, "cache_control": {"type": "ephemeral"}}]
FIELDS = ("input_tokens", "cached_tokens", "cache_write_tokens", "output_tokens")


def _litellm_bin() -> str | None:
    return os.environ.get("EVALPLANE_LITELLM") or shutil.which("litellm", path=str(Path(sys.executable).parent))


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    """(litellm_url, master_key, clean_sim_url, faulty_sim_url): one proxy, two model groups."""
    from tests.tiers import unavailable

    exe = _litellm_bin()
    if exe is None:
        unavailable("LiteLLM", "no litellm executable in the project venv")
    with ExitStack() as stack:
        clean = stack.enter_context(running_simulator(SimulatorConfig(api_key=SIM_KEY)))
        faulty = stack.enter_context(running_simulator(SimulatorConfig(
            api_key=SIM_KEY, error_rate=0.4, error_statuses=[529], seed=7)))
        d = tmp_path_factory.mktemp("litellm")
        (d / "cfg.yaml").write_text(
            "model_list:\n"
            + "".join(f"  - model_name: {name}\n    litellm_params:\n      model: anthropic/{MODEL}\n"
                      f"      api_base: {url}\n      api_key: os.environ/SIM_KEY\n"
                      for name, url in ((MODEL, clean), (FAULTY, faulty)))
            + "litellm_settings:\n  num_retries: 0\n  request_timeout: 60\n"
            "general_settings:\n  master_key: os.environ/LITELLM_MASTER_KEY\n"
        )
        master = "sk-" + secrets.token_hex(32)
        port = free_port()
        # DB-less: the proxy must not see the project's DATABASE_URL (it would switch to its Prisma mode).
        env = {**{k: v for k, v in os.environ.items() if k != "DATABASE_URL"},
               "LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_MASTER_KEY": master, "SIM_KEY": SIM_KEY}
        base = f"http://127.0.0.1:{port}"
        litellm = Service([exe, "--config", str(d / "cfg.yaml"), "--port", str(port), "--num_workers", "1"],
                          name="litellm", env=env, log=d / "litellm.log", ready=lambda: _live(base), timeout_s=240,
                          poll_s=0.2, grace_s=20)
        try:
            stack.enter_context(litellm)
        except ServiceFailed as e:
            text = (d / "litellm.log").read_text()[-600:]
            if "Missing dependency" in text:
                unavailable("LiteLLM", f"proxy extras missing (set EVALPLANE_LITELLM): {text.splitlines()[-1]}")
            raise RuntimeError(f"litellm exited: {text}") from e
        yield base, master, clean, faulty


def _live(base: str) -> bool:
    try:
        return httpx.get(f"{base}/health/liveliness", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def _truth(url: str) -> Usage:
    t = sim_stats(url, MODEL)
    return Usage(**{f: t.get(f, 0) for f in FIELDS})


def _calls(s, topic: str, n: int = 1) -> None:
    """Both wire formats, streaming and not; the second turn of each reads the first one's cache."""
    a, o = s.anthropic(), s.openai()
    for i in range(n):
        history = [{"role": "user", "content": f"Fix the bug in {topic} #{i}."}]
        msg = a.messages.create(model="x", max_tokens=200, system=SYSTEM, messages=history)
        assert msg.content[0].text
        history += [{"role": "assistant", "content": msg.content[0].text}, {"role": "user", "content": "Then?"}]
        with a.messages.stream(model="x", max_tokens=200, system=SYSTEM, messages=history) as st:
            assert st.get_final_text()
        chat = [{"role": "system", "content": "Be brief. " * 30}, {"role": "user", "content": f"Explain {topic} {i}."}]
        r = o.chat.completions.create(model="x", messages=chat, max_tokens=100)
        assert r.choices[0].message.content
        chunks = list(o.chat.completions.create(model="x", messages=chat, max_tokens=100, stream=True))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def test_usage_and_cost_match_truth_through_litellm(gateway, shim, unique):
    base, master, clean, _ = gateway
    httpx.post(f"{clean}/_sim/reset")
    s = shim(base, key=master, model=MODEL)
    _calls(s, unique)
    rows = s.rows()
    assert len(rows) == 4 and all(r["outcome"] == "ok" and not r["usage_estimated"] for r in rows), rows
    assert len({r["gateway_call_id"] for r in rows if r["gateway_call_id"]}) == 4  # each row names its LiteLLM call
    got = Usage(**{f: sum(r[f] for r in rows) for f in FIELDS})
    truth = _truth(clean)
    assert got == truth
    assert truth.cached_tokens > 0 and truth.cache_write_tokens > 0
    assert sum(r["cost_usd"] for r in rows) == pytest.approx(price(MODEL).cost(truth), rel=1e-9)


def test_litellm_529_as_500_is_retried(gateway, shim, unique):
    base, master, _, faulty = gateway
    httpx.post(f"{faulty}/_sim/reset")
    s = shim(base, key=master, model=FAULTY, max_attempts=15)
    _calls(s, unique, n=3)
    rows = s.rows()
    assert len(rows) == 12 and all(r["outcome"] == "ok" and r["http_status"] == 200 for r in rows), rows
    truth_stats = sim_stats(faulty, MODEL)
    injected = truth_stats["errors"].get("529", 0)
    assert injected >= 3 and set(truth_stats["errors"]) == {"529"}
    assert sum(r["retries"] for r in rows) == injected  # each LiteLLM 500 (a 529 upstream) was retried
    got = Usage(**{f: sum(r[f] for r in rows) for f in FIELDS})
    assert got == _truth(faulty)
    # what LiteLLM made of the 529s: 1.108.7 answered 500 + overloaded_error (notes 1.10; that body is replayed
    # in test_shim_retries); 1.110.2 answers 529 on /v1/messages and 503 on /v1/chat/completions
    seen = {int(m) for m in re.findall(r"upstream (\d+) \(attempt", s.log())}
    assert seen and seen <= {500, 503, 529}, seen
