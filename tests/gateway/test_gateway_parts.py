"""The gateway's parts that need no service: token kinds from LiteLLM's usage, deployments from a run's upstream,
the provider key file, and how the report tells two meters' rows apart."""

from __future__ import annotations

import stat

from dispatcher.report.reconcile import TOKENS, _difference
from gateway import keyfile, runs
from gateway.runtime import tokens


def test_tokens_by_kind_from_litellm_usage():
    # Anthropic through LiteLLM: prompt_tokens counts cache reads and cache writes
    usage = {"prompt_tokens": 41500, "completion_tokens": 60, "prompt_tokens_details": {"cached_tokens": 40000},
             "cache_creation_input_tokens": 300}
    assert tokens(usage) == {"input_tokens": 1200, "cached_tokens": 40000, "cache_write_tokens": 300,
                             "output_tokens": 60}
    assert tokens(None) == dict.fromkeys(("input_tokens", "cached_tokens", "cache_write_tokens", "output_tokens"), 0)


def test_a_deployment_names_its_key_and_never_holds_it():
    d = runs.deployment("openai", "gpt-4o-mini", "http://127.0.0.1:9/v1/", runs.key_name("sk-provider-secret"))
    assert (d.model, d.api_base) == ("openai/gpt-4o-mini", "http://127.0.0.1:9/v1")
    assert "sk-provider-secret" not in d.model_dump_json() and d.key_name.startswith("key-")
    a = runs.deployment("anthropic", "claude-sonnet-4-5", "http://127.0.0.1:9", "k")
    assert a.api_base == "http://127.0.0.1:9"


def test_the_key_file_is_private_and_keeps_every_key(tmp_path):
    f = tmp_path / "gw" / "provider-keys.json"
    keyfile.put(f, "a", "sk-a")
    keyfile.put(f, "b", "sk-b")
    assert keyfile.read(f) == {"a": "sk-a", "b": "sk-b"}
    assert stat.S_IMODE(f.stat().st_mode) == 0o600


def _row(shim=1, gw=1, **over):
    row = {"shim_call_id": "s1" if shim else None, "shim_gateway_call_id": "g1" if shim else None,
           "g_gateway_call_id": "g1" if gw else None}
    for t in (*TOKENS, "cost_usd"):
        row[f"shim_{t}"] = row[f"g_{t}"] = 10
    return row | over


def test_the_report_names_what_differs():
    assert _difference(_row()) is None
    assert _difference(_row(g_output_tokens=11)) == "output_tokens 10 vs 11"
    assert "cost" in _difference(_row(g_cost_usd=10.5))
    assert _difference(_row(shim=0)) == "the gateway served it; no shim row"
    assert _difference(_row(gw=0)) == "no gateway row for the shim row's call id"
