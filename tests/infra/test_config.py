"""The stack config is validated as a whole: the "evalplane" namespace read from Pulumi's config, through EstateConfig."""

from __future__ import annotations

import json
from pathlib import Path

import pulumi
import pytest
import yaml

from components.config import (
    CONFIG_KEYS,
    NAMESPACE,
    ConfigError,
    EstateConfig,
    config_from_mapping,
    from_pulumi_config,
    namespace_config,
)

ROOT = Path(__file__).resolve().parents[2]

# The keys as docs/infra.md and Pulumi.dev.yaml name them: renaming one breaks every stack that sets it.
KEYS = [
    "prefix", "azCount", "vpcCidr", "harnessCidr", "targetTasks", "headroom", "natPerAz", "extraEndpoints",
    "auroraEngineVersion", "auroraMinAcu", "auroraMaxAcu", "valkeyNodeType", "valkeyEngineVersion",
    "protectData", "logRetentionDays", "logExpiryDays", "trajectoryIaDays", "trajectoryExpiryDays",
    "gatewayImageTag", "evalWorkerImageTag", "judgeImageTag", "packageIndexImageTag",
    "gatewayReplicas", "gatewayCpu", "gatewayMemory", "gatewayProviders", "harnessCpu", "harnessMemory",
    "harnessEphemeralGb", "judgeCpu", "judgeMemory", "queuePrefix", "evalInstanceType", "evalMaxInstances",
    "evalDiskGb", "evalWorkerCpu", "evalWorkerMemory", "packageIndexReplicas", "packageIndexUpstream",
    "headInstanceType", "headDiskGb", "buildInstanceType", "buildMaxInstances", "buildDiskGb",
    "taskImageExpiryDays", "guardSchedule", "guardTimezone", "deadlineSchedule", "guardEnabled",
    "monthlyBudgetUsd", "budgetEmails"
]


@pytest.fixture
def stack_config(monkeypatch):
    """Set the stack config as the engine hands it to the program; cleared again afterwards."""
    monkeypatch.delenv("PULUMI_CONFIG", raising=False)
    pulumi.runtime.set_all_config({})

    def put(values: dict[str, str], secret_keys: list[str] | None = None) -> None:
        pulumi.runtime.set_all_config(values, secret_keys)

    yield put
    pulumi.runtime.set_all_config({}, [])


def _dev_stack_config() -> dict[str, str]:
    """Pulumi.dev.yaml as the CLI hands it to the program: every value a string, objects and lists as JSON."""
    raw = yaml.safe_load((ROOT / "Pulumi.dev.yaml").read_text())["config"]
    return {k: v if isinstance(v, str) else json.dumps(v) for k, v in raw.items()}


def test_the_keys_are_the_documented_ones():
    assert list(CONFIG_KEYS) == KEYS and len(KEYS) == 51
    doc = (ROOT / "docs/infra.md").read_text()
    assert all(f"`{k}`" in doc for k in KEYS)


def test_a_mistyped_key_is_an_error_naming_it(stack_config):
    stack_config({"aws:region": "us-east-1", "evalplane:azCount": "3", "evalplane:monthlyBudgteUsd": "50"})
    with pytest.raises(ConfigError, match="evalplane:monthlyBudgteUsd") as err:
        from_pulumi_config()
    assert "did you mean evalplane:monthlyBudgetUsd" in str(err.value)
    assert "azCount" not in str(err.value)  # the valid keys are not reported


def test_a_python_field_name_is_not_a_config_key(stack_config):
    stack_config({"evalplane:az_count": "4"})
    with pytest.raises(ConfigError, match="evalplane:az_count: not a config key.*evalplane:azCount"):
        from_pulumi_config()


def test_a_wrongly_typed_value_is_an_error_naming_its_key(stack_config):
    stack_config({"evalplane:evalMaxInstances": "fifty", "evalplane:natPerAz": "maybe",
                  "evalplane:budgetEmails": "ops@example.com"})
    with pytest.raises(ConfigError) as err:
        from_pulumi_config()
    msg = str(err.value)
    assert "evalplane:evalMaxInstances: Input should be a valid integer" in msg and "'fifty'" in msg
    assert "evalplane:natPerAz: Input should be a valid boolean" in msg
    assert "evalplane:budgetEmails: expected a JSON list of strings" in msg
    with pytest.raises(ConfigError, match=r"evalplane:gatewayProviders \(item 1\): Input should be a valid string"):
        config_from_mapping({"gatewayProviders": '["ANTHROPIC_API_KEY", 7]'})


def test_a_rule_broken_by_the_config_names_its_key(stack_config):
    stack_config({"evalplane:harnessEphemeralGb": "300"})
    with pytest.raises(ConfigError, match="evalplane:harnessEphemeralGb: harnessEphemeralGb must be between 21 and 200"):
        from_pulumi_config()
    with pytest.raises(ConfigError, match="auroraMaxAcu must be >= auroraMinAcu"):
        config_from_mapping({"auroraMinAcu": "8", "auroraMaxAcu": "4"})


def test_a_secret_value_is_not_echoed(stack_config, monkeypatch):
    stack_config({"evalplane:gatewayImageTag": "x", "evalplane:gatewayCpu": "hunter2"}, ["evalplane:gatewayCpu"])
    with pytest.raises(ConfigError, match="evalplane:gatewayCpu") as err:
        from_pulumi_config()
    assert "hunter2" not in str(err.value)
    stack_config({})
    monkeypatch.setenv("PULUMI_CONFIG", json.dumps({"evalplane:gatewayCpu": "hunter2"}))
    monkeypatch.setenv("PULUMI_CONFIG_SECRET_KEYS", json.dumps(["evalplane:gatewayCpu"]))
    with pytest.raises(ConfigError, match="evalplane:gatewayCpu") as err:
        from_pulumi_config()
    assert "hunter2" not in str(err.value)


def test_strings_are_converted_and_other_namespaces_ignored(stack_config):
    stack_config({
        "aws:region": "eu-west-1", "other:thing": "x",
        "evalplane:azCount": "4", "evalplane:headroom": "2", "evalplane:natPerAz": "true",
        "evalplane:auroraMaxAcu": "8.5", "evalplane:extraEndpoints": '["ecs"]', "evalplane:prefix": "",
    })
    cfg = from_pulumi_config()
    assert (cfg.az_count, cfg.headroom, cfg.nat_per_az, cfg.aurora_max_acu) == (4, 2.0, True, 8.5)
    assert cfg.extra_endpoints == ("ecs",)
    assert cfg.prefix == "evalplane"  # an empty string key keeps its default, as before
    assert cfg == EstateConfig(az_count=4, headroom=2.0, nat_per_az=True, aurora_max_acu=8.5, extra_endpoints=["ecs"])
    with pytest.raises(ValueError):
        cfg.az_count = 5  # frozen


def test_no_config_is_the_default_estate(stack_config):
    stack_config({"aws:region": "us-east-1"})
    assert from_pulumi_config() == EstateConfig()


def test_the_dev_stack_config_validates(stack_config):
    dev = _dev_stack_config()
    assert dev["evalplane:budgetEmails"] == '["ops@example.com"]'
    stack_config(dev)
    cfg = from_pulumi_config()
    assert cfg.budget_emails == ("ops@example.com",)
    assert (cfg.az_count, cfg.target_tasks, cfg.headroom, cfg.guard_enabled) == (3, 20_000, 1.5, True)
    assert cfg.guard_schedule == "cron(0 2 * * ? *)" and cfg.package_index_replicas == 1
    ours = {k.split(":", 1)[1] for k in dev if k.startswith(f"{NAMESPACE}:")}
    assert ours and ours <= set(KEYS)


def test_the_language_hosts_config_bag_is_read_whole(stack_config, monkeypatch):
    """`pulumi up` hands the program its config as PULUMI_CONFIG (JSON); its keys are listed from there."""
    monkeypatch.setenv("PULUMI_CONFIG", json.dumps(_dev_stack_config()))
    assert namespace_config()["azCount"] == "3"
    assert from_pulumi_config().budget_emails == ("ops@example.com",)
    monkeypatch.setenv("PULUMI_CONFIG", json.dumps({**_dev_stack_config(), "evalplane:guardEnable": "false"}))
    with pytest.raises(ConfigError, match="evalplane:guardEnable: .*did you mean evalplane:guardEnabled"):
        from_pulumi_config()
    # a PULUMI_CONFIG_<KEY> variable overrides one key (pulumi.Config's precedence), for the known keys
    monkeypatch.setenv("PULUMI_CONFIG_EVALPLANE_AZCOUNT", "5")
    monkeypatch.setenv("PULUMI_CONFIG", json.dumps({"evalplane:natPerAz": "true"}))
    cfg = from_pulumi_config()
    assert (cfg.az_count, cfg.nat_per_az) == (5, True)
