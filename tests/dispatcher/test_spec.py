"""The spec: every mistake named with its field path and line; a bad spec writes nothing."""

import subprocess
import sys
from pathlib import Path

import pytest

from dispatcher.plan import make_plan
from dispatcher.spec import SpecError, load_spec

ROOT = Path(__file__).resolve().parents[2]
DATASETS = ROOT.parent / "shared" / "datasets"

GOOD = """
[run]
name = "{name}"
[harness]
name = "mini-swe-agent"
[model]
provider = "openai"
model = "gpt-4o-mini"
[instances]
dataset = "{dataset}"
{extra}
[budget]
run_usd = 1.0
"""


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "spec.toml"
    p.write_text(text)
    (tmp_path / "x.json").write_text("{}")  # a stack-outputs file for the specs with backend aws
    return p


def test_example_spec_is_valid():
    spec = load_spec(ROOT / "examples" / "local.toml")
    plan = make_plan(spec)
    assert len(plan.rows) == len(plan.refs) >= 3
    assert spec.pool == "gpt-4o-mini@mini-swe-agent"
    assert all(Path(s).is_file() for s in plan.repo_sources.values())


@pytest.mark.parametrize("name,count", [
    ("SWE-bench_Verified_test.parquet", 500), ("SWE-bench_Lite_test.parquet", 300), ("SWE-bench_Lite_dev.parquet", 23)])
def test_shared_parquet_datasets_load(tmp_path, name, count):
    spec = load_spec(write(tmp_path, GOOD.format(name="p", dataset=DATASETS / name, extra="")
                           .replace('[budget]', '[backend]\nkind = "aws"\nstack_outputs = "x.json"\n[budget]')))
    assert len(make_plan(spec).rows) == count


def test_ids_filter_and_slice(tmp_path):
    extra = 'filter = { repo = "django/django" }\nslice = "2:7"'
    spec = load_spec(write(tmp_path, GOOD.format(name="p", dataset=DATASETS / "SWE-bench_Verified_test.parquet", extra=extra)
                           .replace('[budget]', '[backend]\nkind = "aws"\nstack_outputs = "x.json"\n[budget]')))
    rows = list(make_plan(spec).rows.values())
    assert len(rows) == 5 and all(r["repo"] == "django/django" for r in rows)


def test_spot_is_for_a_backend_with_spot_capacity(tmp_path):
    def spec(kind: str):
        return load_spec(write(tmp_path, GOOD.format(name="p", dataset=ROOT / "examples/synthetic/instances.jsonl",
                                                     extra="").replace(
            "[budget]", f'[backend]\nkind = "{kind}"\nstack_outputs = "x.json"\nspot = 0.5\n[budget]')))

    assert spec("aws").backend.spot == 0.5
    with pytest.raises(SpecError) as e:
        spec("local")
    assert "spot" in str(e.value) and "no Spot capacity" in str(e.value)


def test_unknown_ids_are_named(tmp_path):
    text = GOOD.format(name="p", dataset=ROOT / "examples/synthetic/instances.jsonl",
                       extra=f'ids = ["nope__nope-1"]\nrepos = "{ROOT / "examples/synthetic/repos"}"')
    with pytest.raises(SpecError) as e:
        make_plan(load_spec(write(tmp_path, text)))
    assert [p.path for p in e.value.problems] == ["instances.ids"]
    assert "nope__nope-1" in e.value.problems[0].message


THREE_MISTAKES = """
[run]
name = "Bad Name!"

[harness]
name = "mini-swe-agent"

[model]
provider = "openai"
model = "gpt-4o-mini"

[instances]
dataset = "does-not-exist.jsonl"

[budget]
run_usd = -5
"""


def test_three_mistakes_three_errors_with_lines(tmp_path):
    with pytest.raises(SpecError) as e:
        load_spec(write(tmp_path, THREE_MISTAKES))
    got = {p.path: p for p in e.value.problems}
    assert set(got) == {"run.name", "instances.dataset", "budget.run_usd"}
    assert got["run.name"].line == 3
    assert got["instances.dataset"].line == 13
    assert got["budget.run_usd"].line == 16
    assert "greater than 0" in got["budget.run_usd"].message


def test_unknown_field_and_toml_syntax(tmp_path):
    with pytest.raises(SpecError) as e:
        load_spec(write(tmp_path, GOOD.format(name="ok", dataset="x", extra="").replace("[budget]", "[budget]\nrun_cap = 3")))
    paths = {p.path for p in e.value.problems}
    assert "budget.run_cap" in paths and "instances.dataset" in paths
    with pytest.raises(SpecError) as e:
        load_spec(write(tmp_path, "[run\nname = 1"))
    assert e.value.problems[0].line == 1


def test_validate_cli_exits_nonzero_and_writes_nothing(tmp_path, database_url):
    import psycopg

    spec = write(tmp_path, THREE_MISTAKES.replace("Bad Name!", "Bad Name!"))
    with psycopg.connect(database_url) as conn:
        before = conn.execute("SELECT count(*) FROM runs").fetchone()[0]
    for cmd in ("validate", "run"):
        p = subprocess.run([sys.executable, "-m", "dispatcher", cmd, str(spec)], capture_output=True, text=True,
                           cwd=tmp_path, env={"DATABASE_URL": database_url, "PATH": "/usr/bin:/bin",
                                              "EVALPLANE_STATE_DIR": str(tmp_path / "state")}, check=False)
        assert p.returncode == 2, p.stderr
        assert "3 problem(s)" in p.stderr
        for field in ("run.name (line 3)", "instances.dataset (line 13)", "budget.run_usd (line 16)"):
            assert field in p.stderr
    with psycopg.connect(database_url) as conn:
        assert conn.execute("SELECT count(*) FROM runs").fetchone()[0] == before
    assert not (tmp_path / "state").exists()


def test_the_simulators_fault_settings_reach_its_command_line(tmp_path):
    from dispatcher.backends.local import simulator_args
    from simulator.config import SimulatorConfig
    from simulator.faults import Faults

    synthetic = GOOD.format(name="p", dataset=ROOT / "examples/synthetic/instances.jsonl",
                            extra=f'repos = "{ROOT / "examples/synthetic/repos"}"')
    spec = load_spec(write(tmp_path, synthetic + '[simulator]\nerror_rate = 0.3\nerror_statuses = [429, 529]\nseed = 4\n'))
    argv = simulator_args(make_plan(spec), tmp_path)
    assert argv[argv.index("--error-rate") + 1] == "0.3" and argv[argv.index("--seed") + 1] == "4"
    assert argv[argv.index("--error-statuses") + 1] == "429,529"
    # the seed the harness runs use: their first call fails, whatever the number of calls
    assert Faults(SimulatorConfig(error_rate=0.3, error_statuses=[429, 529], seed=4)).status() == 429
    unseeded = simulator_args(make_plan(load_spec(write(tmp_path, synthetic))), tmp_path)
    assert "--seed" not in unseeded


def _with_backend(tmp_path: Path, backend: str) -> Path:
    (tmp_path / "i.jsonl").write_text("")
    return write(tmp_path, GOOD.format(name="res", dataset="i.jsonl", extra="") + "[backend]\n" + backend)


def test_task_resources_take_sizes_and_default_the_limit_to_the_guarantee(tmp_path):
    spec = load_spec(_with_backend(tmp_path, 'task_cpu = 2\ntask_memory = "2g"\n'))
    r = spec.backend.resources
    assert (r.cpu, r.memory_mib, r.memory_limit_mib) == (2.0, 2048, 2048)
    spec = load_spec(_with_backend(tmp_path, 'task_memory = 1536\ntask_memory_limit = "6GiB"\n'))
    assert (spec.backend.resources.memory_mib, spec.backend.resources.memory_limit_mib) == (1536, 6144)


@pytest.mark.parametrize(("backend", "field", "words"), [
    ('task_memory = "lots"\n', "backend.task_memory", "not a memory size"),
    ("task_cpu = 0\n", "backend.task_cpu", "greater than 0"),
    ('task_memory = "8g"\ntask_memory_limit = "4g"\n', "backend.task_memory_limit", "below task_memory"),
])
def test_bad_task_resources_are_refused_naming_the_field(tmp_path, backend, field, words):
    with pytest.raises(SpecError) as e:
        load_spec(_with_backend(tmp_path, backend))
    (problem,) = e.value.problems
    assert problem.path == field and words in problem.message and problem.line is not None


@pytest.mark.parametrize(("extra", "provider_keys", "holder"), [
    ("", None, "shims' reservation alone"),
    ("[gateway]\n", "simulator", "provider key (simulator)"),
    ('[gateway]\nprovider_keys = "simulator"\n', "simulator", "provider key (simulator)"),
])
def test_the_spec_says_what_holds_the_run_cap(tmp_path, extra, provider_keys, holder):
    spec = load_spec(write(tmp_path, GOOD.format(name="cap", dataset="synthetic", extra=extra)))
    assert spec.provider_keys == provider_keys and holder in spec.cap_holder()


def test_a_real_provider_without_provider_keys_falls_back_to_the_gateway_keys_budget(tmp_path):
    text = GOOD.format(name="cap", dataset="synthetic", extra="[gateway]\n").replace(
        'model = "gpt-4o-mini"', 'model = "gpt-4o-mini"\nbase_url = "https://gateway.invalid"')
    spec = load_spec(write(tmp_path, text))
    assert spec.provider_keys is None and "gateway key's budget" in spec.cap_holder()
    with pytest.raises(SpecError, match="gateway.provider_keys"):
        load_spec(write(tmp_path, GOOD.format(name="cap", dataset="synthetic",
                                              extra='[gateway]\nprovider_keys = "no-such"\n')))
