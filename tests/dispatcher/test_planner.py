"""Fleet sizing from limits and the ledger."""

import json
import math
import uuid
from datetime import UTC, datetime

from psycopg.types.json import Jsonb
from test_launcher_ecs import estate, manual_progression  # noqa: F401 (fixtures: a stack-outputs file)

from contract.pricing import price
from dispatcher import cli
from dispatcher.driver.fleet import (
    PRIOR,
    Planner,
    PoolObservation,
    feedable,
    launch_seconds,
    observe,
    predict,
)

OBS = PoolObservation(basis="t", calls_per_attempt=30, input_per_call=2000, cached_per_call=10000,
                      output_per_call=300, attempt_minutes=10)


def test_feedable_is_the_tightest_limit():
    # 3 calls/min per attempt; rpm 300 feeds 100 attempts, itpm 120k feeds 60/3=20, otpm 90k feeds 300/3=100
    assert feedable({"rpm": 300, "itpm": 120_000, "otpm": 90_000}, OBS) == 20
    assert math.isinf(feedable({}, OBS))


def test_target_grows_while_wait_is_low_and_holds_when_tasks_would_wait():
    p = Planner(max_concurrency=500)
    limits = {"rpm": 3000}
    assert p.target(limits, OBS, remaining=10_000, current=10) == 15
    assert p.target(limits, OBS, remaining=10_000, current=900) == 500  # the spec bounds it
    assert p.target(limits, OBS, remaining=3, current=2) == 3  # never more than what is left
    waiting = OBS.model_copy(update={"pacer_wait_share": 0.3})
    assert p.target(limits, waiting, remaining=10_000, current=40) == 40
    assert p.target({"rpm": 30}, OBS, remaining=10_000, current=40) == 10  # the limits feed only 10


def test_prediction_uses_prices_and_budget():
    pr = predict(100, {"rpm": 300}, OBS, price("gpt-4o-mini"), max_concurrency=50, run_usd=1000)
    assert pr.concurrency == 50 and pr.wall_time_s == 2 * 10 * 60
    per_call = 2000 * 1.5e-7 + 10000 * 7.5e-8 + 300 * 6e-7
    assert abs(pr.cost_usd - 100 * 30 * per_call) < 1e-9 and not pr.capped_by_budget
    assert predict(100, {}, OBS, price("gpt-4o-mini"), 50, run_usd=0.5).capped_by_budget


def test_observe_reads_the_ledger(pg, unique):
    assert observe(pg, unique) == PRIOR
    pg.execute("INSERT INTO runs (run, spec, spec_hash, backend, attempts) VALUES (%s, %s, 'h', 'local', 1)",
               (unique, Jsonb({})))
    pg.execute("""INSERT INTO attempts (run, instance_id, attempt, harness, pool, model, outcome, status, calls,
                  wall_time_s) VALUES (%s, 'i', 1, 'h', %s, 'm', 'submitted', 'RESOLVED', 2, 120)""", (unique, unique))
    for i, (inp, out, wait) in enumerate([(1000, 100, 50.0), (3000, 300, 150.0)]):
        pg.execute("""INSERT INTO calls (call_id, run, instance_id, attempt, seq, pool, provider, model, route, stream,
                      started_at, input_tokens, cached_tokens, cache_write_tokens, output_tokens, cost_usd, latency_ms,
                      pacer_wait_ms, retries, http_status, outcome, usage_estimated)
                      VALUES (%s,%s,'i',1,%s,%s,'openai','m','/v1/chat/completions',false,%s,%s,0,0,%s,0,1000,%s,0,200,
                      'ok',false)""", (uuid.uuid4(), unique, i + 1, unique, datetime.now(UTC), inp, out, wait))
    pg.commit()
    obs = observe(pg, unique)
    assert obs.basis == "ledger (1 attempts)"
    assert (obs.calls_per_attempt, obs.input_per_call, obs.output_per_call, obs.attempt_minutes) == (2, 2000, 200, 2)
    assert abs(obs.pacer_wait_share - 0.1) < 1e-9


def test_launch_time_follows_the_quota():
    assert launch_seconds(20_000, 20.0, 100) == (20_000 - 100) / 20.0
    assert launch_seconds(50, 20.0, 100) == 0 and launch_seconds(20_000, None) == 0
    slow = OBS.model_copy(update={"attempt_minutes": 1})
    # 20,000 at once: starting them takes 995 s, then the last one runs its minute
    pr = predict(20_000, {}, slow, None, max_concurrency=20_000, run_usd=1e9, launch_rate_per_s=20.0,
                 launch_burst=100)
    assert pr.launch_s == 995 and pr.wall_time_s == 995 + 60
    # 100 at a time: the waves dominate, the first wave starts at once (a burst)
    pr = predict(20_000, {}, slow, None, max_concurrency=100, run_usd=1e9, launch_rate_per_s=20.0, launch_burst=100)
    assert pr.wall_time_s == 200 * 60


def test_plan_of_a_20000_attempt_aws_spec_prints_the_launch_time(estate, tmp_path, unique, database_url,  # noqa: F811
                                                                 capsys):
    """`python -m dispatcher plan` on AWS: 20,000 tasks at Fargate's quota (20 a second after a burst of 100) take
    995 s to start, and the wall time includes them."""
    rows = [{"instance_id": f"big__big-{i}", "repo": "big/big", "base_commit": "0" * 40, "version": "0.1",
             "problem_statement": "x", "FAIL_TO_PASS": "[]", "PASS_TO_PASS": "[]",
             "image": f"swebench/sweb.eval.x86_64.big_1776_big-{i}:latest", "eval_script": "true",
             "log_parser": "parse_log_pytest", "eval_type": "pass_and_fail"} for i in range(20_000)]
    (tmp_path / "big.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    spec = tmp_path / "aws.toml"
    spec.write_text(f"""
[run]
name = "{unique}"
[harness]
name = "mini-swe-agent"
[model]
provider = "anthropic"
model = "claude-sonnet-4-5"
pool = "{unique}"
[instances]
dataset = "big.jsonl"
[budget]
run_usd = 100000
[backend]
kind = "aws"
stack_outputs = "{estate}"
concurrency = 20000
""")
    rc = cli.main(["plan", str(spec)])
    out, err = capsys.readouterr()
    assert rc == cli.EXIT_SPEC and "20000 instance(s) without what their task image needs" in err, err[:2000]
    assert "predicted launch time: 16.6 min to start 20000 task(s) at the ECS launch quota (20 tasks/s after a burst" \
           " of 100" in out, out
    assert "predicted wall time: 24.6 min (launch time included)" in out  # 995 s to start, then 8 min (the prior)
