"""The harness seam without containers: the registry, the spec's [harness] table validated against each adapter's
settings model (errors naming the field), the launcher chosen for harnesses that live only in their image layer, and
each adapter's process: its argv, its config pointing at the shim, its calls home turned off, no provider key."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest

from contract.models import AttemptLimits, AttemptRef, HarnessRef, Job, ModelRef
from dispatcher.spec import SpecError, load_spec
from harness.adapters import ADAPTERS, HarnessAdapter, UnknownHarness, load_adapter

ROOT = Path(__file__).resolve().parents[2]
SPEC = """
[run]
name = "seam"
[harness]
name = "{harness}"
{settings}
[model]
provider = "{provider}"
model = "m"
[instances]
dataset = "{dataset}"
[budget]
run_usd = 1.0
{backend}
"""


def spec(tmp_path: Path, harness: str, settings: str = "", provider: str = "openai", backend: str = ""):
    p = tmp_path / "spec.toml"
    p.write_text(SPEC.format(harness=harness, settings=settings, provider=provider, backend=backend,
                             dataset=ROOT / "examples/synthetic/instances.jsonl"))
    return load_spec(p)


def problems(tmp_path: Path, **kw) -> dict[str, str]:
    with pytest.raises(SpecError) as e:
        spec(tmp_path, **kw)
    return {p.path: p.message for p in e.value.problems}


def test_registry_and_dotted_paths():
    assert {"mini-swe-agent", "claude-code", "codex", "opencode"} <= set(ADAPTERS)
    assert all(issubclass(a, HarnessAdapter) and a.version and a.layer_dir().joinpath("Dockerfile").is_file()
               for a in ADAPTERS.values())
    assert load_adapter("harness.adapters.codex:Codex") is ADAPTERS["codex"]
    for bad in ("sweagent", "harness.adapters.codex:Nope", "json:dumps"):
        with pytest.raises(UnknownHarness):
            load_adapter(bad)


def test_spec_harness_name_and_settings_name_the_field(tmp_path):
    assert "unknown harness 'sweagent'" in problems(tmp_path, harness="sweagent")["harness.name"]
    got = problems(tmp_path, harness="claude-code", provider="anthropic", settings='settings = { tools = 3, x = 1 }')
    assert set(got) == {"harness.settings.tools", "harness.settings.x"}, got
    assert got["harness.settings.x"] == "unknown field" or "Extra" in got["harness.settings.x"]
    ok = spec(tmp_path, harness="claude-code", provider="anthropic", settings='settings = { tools = "Bash" }')
    assert ok.harness.settings == {"tools": "Bash"}
    assert problems(tmp_path, harness="codex", provider="anthropic") == {
        "model.provider": "harness codex speaks only to openai; with [gateway] it takes a model of any provider the"
                          " gateway serves"}
    # through the gateway, which translates between wire formats
    assert spec(tmp_path, harness="codex", provider="anthropic", backend="[gateway]").model.provider == "anthropic"
    assert spec(tmp_path, harness="claude-code", provider="openai", backend="[gateway]").gateway is not None


def test_npm_harnesses_choose_the_docker_launcher(tmp_path):
    assert spec(tmp_path, harness="mini-swe-agent").backend.launcher == "process"
    assert spec(tmp_path, harness="opencode").backend.launcher == "docker"
    assert spec(tmp_path, harness="opencode").eval.backend == "docker"
    got = problems(tmp_path, harness="opencode", backend='[backend]\nlauncher = "process"')
    assert list(got) == ["backend.launcher"] and "docker" in got["backend.launcher"]


def job(harness: str, provider: str = "openai", **limits) -> Job:
    return Job(ref=AttemptRef(run="r", instance_id="i", attempt=1), harness=HarnessRef(name=harness),
               model=ModelRef(provider=provider, model="m", pool="p"), limits=AttemptLimits(**limits),
               instance={"instance_id": "i", "problem_statement": "Fix the bug.", "base_commit": "abc"},
               repo_source="/testbed", upstream_url="http://u", valkey_url="redis://v", results_queue_url="q",
               artifacts_prefix="s3://b/p/", run_cost_usd=1.0)


@pytest.mark.parametrize("name,provider", [("claude-code", "anthropic"), ("codex", "openai"), ("opencode", "openai")])
def test_each_adapter_points_at_the_shim_and_calls_nobody_else(tmp_path, name, provider):
    adapter = ADAPTERS[name]()
    j = job(name, provider, max_turns=7, cost_usd=0.5)
    run = adapter.prepare(j, Path("/testbed"), tmp_path, "http://127.0.0.1:9", "local-token", {"PATH": "/usr/bin"})
    assert run.argv[0] == str(adapter.install_dir() / "bin" / next(iter(adapter.binaries)))
    assert run.stdin is not None and "Fix the bug." in run.stdin.read_text()
    assert not any("UPSTREAM" in k or k.startswith(("AWS_", "SHIM_")) for k in run.env)
    assert Path(run.env["HOME"]).is_relative_to(tmp_path)  # never /root, never /testbed
    if name == "claude-code":
        assert run.env["ANTHROPIC_BASE_URL"] == "http://127.0.0.1:9" and run.env["ANTHROPIC_API_KEY"] == "local-token"
        assert all(run.env[k] == "1" for k in ("IS_SANDBOX", "DISABLE_TELEMETRY", "DISABLE_ERROR_REPORTING",
                                               "DISABLE_AUTOUPDATER", "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC"))
        assert run.argv[run.argv.index("--max-turns") + 1] == "7" and "--max-budget-usd" in run.argv
    if name == "codex":
        cfg = tomllib.loads((Path(run.env["CODEX_HOME"]) / "config.toml").read_text())
        provider_cfg = cfg["model_providers"][cfg["model_provider"]]
        assert provider_cfg["base_url"] == "http://127.0.0.1:9/v1" and provider_cfg["wire_api"] == "responses"
        assert run.env[provider_cfg["env_key"]] == "local-token"
        assert cfg["check_for_update_on_startup"] is False and cfg["analytics"]["enabled"] is False
        assert cfg["features"]["unbounded_connection_retries"] is False and cfg["web_search"] == "disabled"
    if name == "opencode":
        cfg = json.loads(Path(run.env["OPENCODE_CONFIG"]).read_text())
        (prov,) = cfg["provider"].values()
        assert prov["options"]["baseURL"] == "http://127.0.0.1:9/v1" and cfg["snapshot"] is False
        assert cfg["autoupdate"] is False and cfg["share"] == "disabled"
        assert run.env[prov["options"]["apiKey"][5:-1]] == "local-token"
