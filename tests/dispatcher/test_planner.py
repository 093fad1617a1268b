"""Fleet sizing from limits and the ledger."""

import json
import math
import tomllib
import uuid
from datetime import UTC, datetime

import pytest
from psycopg.types.json import Jsonb
from test_launcher_ecs import estate, manual_progression  # noqa: F401 (fixtures: a stack-outputs file)

from contract.pricing import price
from dispatcher import cli
from dispatcher.driver.fleet import (
    PRIOR,
    Planner,
    PoolObservation,
    feedable,
    gateway_replicas,
    launch_seconds,
    observe,
    predict,
    size_gateway,
)
from tests.prices import TABLE

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
    assert observe(pg, unique) == PRIOR.model_copy(update={"calling": 0})  # no call: nothing is calling
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
[eval]
workers = 1000
[gateway]
""")
    rc = cli.main(["plan", str(spec)])
    out, err = capsys.readouterr()
    assert rc == cli.EXIT_SPEC and "20000 instance(s) without what their task image needs" in err, err[:2000]
    assert "predicted launch time: 16.6 min to start 20000 task(s) at the ECS launch quota (20 tasks/s after a burst" \
           " of 100" in out, out
    # 995 s to start, then 8 min (the prior); 20,000 gradings of 5 min (the prior) at 1,000 eval workers, from the
    # first attempts' end (8 min): 108 min, 83.4 min after the attempts; 30 s to start the run (the prior)
    assert ("predicted wall time: 108.5 min (30 s start-up from prior, 24.6 min of attempts with the launch time,"
            " 83.4 min of grading after them at 1000 eval worker(s))") in out, out
    # 20,000 attempts of 40 calls in 8 min (the prior): 1,666.7 calls/s, at half of 40 calls/s per replica
    assert ("gateway tier: 84 replica(s) for 1666.7 calls/s at the predicted fleet (a replica serves 40 calls/s flat"
            " out, sized to half of it; gateway.replica_calls_per_s)") in out, out
    # compute: each task at the spec's default size (1 vCPU, 4 GiB) for the prior's 8 minutes, each grading 5
    table = tomllib.loads(TABLE.read_text())
    t, g = table["task"], table["grading"]
    task = 20_000 * 8 / 60 * (1 * t["on_demand_vcpu_hour"] + 4 * t["on_demand_gb_hour"])
    grading = 20_000 * 5 / 60 * g["instance_hour"] / g["gradings_per_instance"]
    assert (f"predicted compute cost: ${task + grading:.4f} (tasks ${task:.4f} at 1 vCPU, 4096 MiB; grading"
            f" ${grading:.4f} at 5.0 min each; compute.toml)") in out, out


def test_target_is_what_the_limits_feed_at_the_observed_turn_with_headroom():
    p = Planner(max_concurrency=500, headroom=1.2)
    turns = OBS.model_copy(update={"turn_s": 6.0, "pacer_wait_share": 0.07})  # 10 calls a minute a task
    # itpm 120k feeds 60 calls a minute: 6 tasks busy, 7 with headroom (floor of 7.2)
    assert p.target({"itpm": 120_000}, turns, remaining=1000, current=2) == 7
    assert p.target({"itpm": 120_000}, turns, remaining=5, current=2) == 5
    assert p.target({"itpm": 1_200_000}, turns, remaining=1000, current=2) == 72  # at once, not step by step
    waiting = turns.model_copy(update={"pacer_wait_share": 0.3})  # waiting more than the headroom explains: hold
    assert p.target({"itpm": 1_200_000}, waiting, remaining=1000, current=40) == 40
    assert p.target({}, turns.model_copy(update={"pacer_wait_share": 0.0}), remaining=1000, current=10) == 15
    # no limits known: step by step


def test_observe_reads_turns_net_of_pacer_wait(pg, unique):
    from datetime import timedelta

    t0 = datetime.now(UTC) - timedelta(seconds=30)
    for a in range(3):
        for seq in range(1, 9):  # a call every 3 s, the first 1 s of each turn waiting on the pacer
            pg.execute("""INSERT INTO calls (call_id, run, instance_id, attempt, seq, pool, provider, model, route,
                          stream, started_at, input_tokens, cached_tokens, cache_write_tokens, output_tokens, cost_usd,
                          latency_ms, pacer_wait_ms, retries, http_status, outcome, usage_estimated)
                          VALUES (%s,%s,'i',%s,%s,%s,'anthropic','m','/v1/messages',false,%s,500,0,0,100,0,1000,1000,0,
                          200,'ok',false)""", (uuid.uuid4(), unique, a + 1, seq, unique, t0 + timedelta(seconds=3 * seq)))
    pg.commit()
    obs = observe(pg, unique)
    assert obs.basis.startswith("prior") and obs.input_per_call == 500  # no attempt ended: the prior's shape
    assert abs(obs.turn_s - 2.0) < 1e-6 and abs(obs.pacer_wait_share - 1 / 3) < 1e-6 and obs.calling == 3
    # no limits known: the next step grows from the three calling, not from the forty launched
    growing = obs.model_copy(update={"turn_s": None, "pacer_wait_share": 0.0})
    assert Planner(500).target({}, growing, remaining=1000, current=40) == 6


def test_tasks_not_calling_yet_are_made_up_for():
    p = Planner(max_concurrency=500, headroom=1.0)
    # 6 calling tasks needed; a task calls for two thirds of its time (the rest: starting, ending)
    turns = OBS.model_copy(update={"turn_s": 6.0, "calling_share": 2 / 3, "pacer_wait_share": 0.07})
    assert p.target({"itpm": 120_000}, turns, remaining=1000, current=9) == 9
    few = turns.model_copy(update={"calling_share": 0.1})
    assert p.target({"itpm": 120_000}, few, remaining=1000, current=9) == 12  # at most twice as many


def test_the_fleet_grows_while_tasks_do_not_wait_and_shrinks_while_they_do():
    p = Planner(max_concurrency=500, headroom=1.0)
    idle = OBS.model_copy(update={"turn_s": 6.0, "pacer_wait_share": 0.0})
    sizes = [p.target({"itpm": 120_000}, idle, remaining=1000, current=6) for _ in range(6)]
    assert sizes[0] == 6 and sizes == sorted(sizes)
    assert sizes[-1] == math.floor(6 * p.max_scale) > 6  # up to max_scale times what the limits feed
    waiting = idle.model_copy(update={"pacer_wait_share": 0.2})
    after = [p.target({"itpm": 120_000}, waiting, remaining=1000, current=20) for _ in range(8)]
    assert after == sorted(after, reverse=True) and after[-1] == 6  # back down, never under what they feed


def test_runs_sharing_a_pool_each_size_for_their_share():
    p = Planner(max_concurrency=500, headroom=1.0)
    alone = OBS.model_copy(update={"turn_s": 6.0, "pacer_wait_share": 0.07})
    assert p.target({"itpm": 1_200_000}, alone, remaining=1000, current=2) == 60
    assert p.target({"itpm": 1_200_000}, alone.model_copy(update={"runs": 2}), remaining=1000, current=2) == 30


def test_spot_tasks_are_predicted_at_the_spot_rates_and_the_saving_is_shown():
    from contract import compute_prices
    from contract.models import TaskResources
    from dispatcher.driver.fleet import predict_compute

    prices, res = compute_prices.load(), TaskResources(cpu=1, memory_mib=4096, memory_limit_mib=4096)
    on_demand = predict_compute(10, PRIOR, res, prices)
    half = predict_compute(10, PRIOR, res, prices, spot=0.5)
    hours = PRIOR.attempt_minutes / 60
    per_task_saving = hours * (prices.task.on_demand_vcpu_hour - prices.task.spot_vcpu_hour
                               + 4 * (prices.task.on_demand_gb_hour - prices.task.spot_gb_hour))
    assert on_demand.spot_saving_usd == 0 and half.spot_saving_usd == pytest.approx(5 * per_task_saving)
    assert half.task_usd == pytest.approx(on_demand.task_usd - half.spot_saving_usd)
    assert half.grading_usd == on_demand.grading_usd


def test_the_gateway_tier_is_sized_for_the_fleets_calls_at_half_a_replicas_capacity():
    assert gateway_replicas(100, 40) == 5  # 100 calls/s at 20 a replica
    assert gateway_replicas(1, 40) == 2  # never fewer than two: losing one must not stop the run
    assert gateway_replicas(1, 40, minimum=1) == 1
    # 30 calls in 10 min: 0.05 calls/s an attempt; 400 attempts make 20 calls/s: 1 replica's half, so two
    p = predict(1000, {}, OBS, None, max_concurrency=400, run_usd=1e9)
    g = size_gateway(p, OBS, 40)
    assert (p.concurrency, g.calls_per_s, g.replicas) == (400, pytest.approx(20), 2)
    assert size_gateway(p, OBS, 4).replicas == 10
    # where the limits bind, the tier serves what they admit: rpm 600 is 10 calls/s, whatever the fleet
    limited = predict(1000, {"rpm": 600}, OBS, None, max_concurrency=400, run_usd=1e9)
    assert size_gateway(limited, OBS, 4).calls_per_s == pytest.approx(10)
