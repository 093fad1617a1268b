"""ShimConfig: unknown fields, wrong types and out-of-bounds values are refused, naming the field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from contract.models import AttemptLimits, AttemptRef
from shim.__main__ import main
from shim.config import ConfigError, ShimConfig

BASE = {"upstream_url": "http://127.0.0.1:9", "provider": "anthropic", "model": "m", "pool": "p",
        "ref": {"run": "r", "instance_id": "i", "attempt": 1}, "local_token": "t", "ledger_path": "/tmp/x.jsonl"}


def test_valid_config_and_defaults():
    c = ShimConfig.model_validate_json(json.dumps({**BASE, "limits": {"cost_usd": 1, "max_turns": 3},
                                                   "batch_size": 10.0, "port_file": "/tmp/p"}))
    assert c.ref.run == "r" and c.ref.attempt == 1 and c.ref.slug == "i/1"
    assert c.limits.cost_usd == 1.0 and c.limits.max_turns == 3 and c.limits.wall_time_s is None
    assert c.batch_size == 10 and isinstance(c.ledger_path, Path) and c.port_file == Path("/tmp/p")
    assert c.max_attempts == 8 and c.pacer_burst_s == 60.0 and c.valkey_url is None and c.run_cost_usd is None
    c = ShimConfig(**{**BASE, "ref": AttemptRef(run="r", instance_id="i", attempt=2),
                      "limits": AttemptLimits(cost_usd=0.5)})
    assert c.ref.attempt == 2 and c.limits.cost_usd == 0.5
    with pytest.raises(ConfigError):  # read-only
        c.model = "other"


@pytest.mark.parametrize("change", [
    {"extra": 1}, {"provider": "google"}, {"local_token": ""}, {"batch_size": 0}, {"batch_size": 201},
    {"batch_interval_s": 0}, {"max_attempts": 0}, {"max_body_bytes": 10}, {"listen_port": "80"},
    {"ref": {"run": "r", "instance_id": "i", "attempt": 0}}, {"ref": {"run": "r", "instance_id": "i"}},
    {"ref": {"run": "r", "instance_id": "i", "attempt": 1, "x": 1}}, {"limits": {"turns": 3}},
    {"backoff_base_s": -1}, {"valkey_url": 5}, {"heartbeat_s": True}, {"model": None},
])
def test_invalid_configs_are_refused(change):
    with pytest.raises(ConfigError) as e:
        ShimConfig.model_validate({**BASE, **change})
    assert e.value.errors()[0]["loc"][0] == next(iter(change))  # the field is named


def test_missing_field_and_bad_file_exit_2(tmp_path, monkeypatch):
    with pytest.raises(ConfigError):
        ShimConfig.model_validate({k: v for k, v in BASE.items() if k != "pool"})
    bad = tmp_path / "shim.json"
    bad.write_text("{not json")
    assert main(["--config", str(bad)]) == 2
    assert main(["--config", str(tmp_path / "missing.json")]) == 2

