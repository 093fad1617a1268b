"""A run's forecast: grading after the attempts, the most relevant ledger, and the forecast against the run."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

import pytest
from psycopg.types.json import Jsonb

from contract.models import TaskResources
from dispatcher import forecast
from dispatcher.driver.fleet import ComputePrediction, PoolObservation

OBS = PoolObservation(basis="t", calls_per_attempt=10, input_per_call=1000, cached_per_call=0, output_per_call=100,
                      attempt_minutes=2, grading_minutes=1)


def test_grading_after_the_attempts_is_one_grading_or_the_graders_backlog():
    # 4 attempts, 2 graders keep up: the last attempt's own grading (60 s) is all that is left
    assert forecast.grading_after(4, first_end_s=120, attempts_s=240, obs=OBS, workers=2) == 60
    # 20 attempts, 1 grader from the first end (120 s): 20 gradings end at 1320 s, 1080 s after the attempts
    assert forecast.grading_after(20, first_end_s=120, attempts_s=240, obs=OBS, workers=1) == 1080
    # half of them have a patch: 10 gradings
    half = OBS.model_copy(update={"graded_share": 0.5})
    assert forecast.grading_after(20, first_end_s=120, attempts_s=240, obs=half, workers=1) == 480
    none = OBS.model_copy(update={"graded_share": 0.0})
    assert forecast.grading_after(20, first_end_s=120, attempts_s=240, obs=none, workers=1) == 0


def made(wall_s: float, token_usd: float | None, task_usd: float, grading_usd: float) -> forecast.Forecast:
    return forecast.Forecast(
        made_at=datetime.now(UTC), attempts=4, concurrency=2, feedable=None, limits={}, limits_source="spec",
        observation=OBS, start_s=10, start_basis="prior", launch_s=0, attempts_s=wall_s - 10, grading_s=0,
        images_to_build=0, image_build_s=0.0, wall_time_s=wall_s, token_usd=token_usd, capped_by_budget=False,
        compute=ComputePrediction(task_usd=task_usd, grading_usd=grading_usd,
                                  resources=TaskResources(cpu=1, memory_mib=4096, memory_limit_mib=4096)))


def test_the_forecast_against_the_run():
    lines = {ln.label: ln for ln in forecast.against(
        made(600, 1.0, 0.2, 0.1), forecast.Actual(wall_time_s=720, token_usd=0.9, compute_usd=0.3))}
    assert lines["wall time"].predicted == 10 and lines["wall time"].ratio == pytest.approx(1.2)
    assert lines["token cost"].ratio == pytest.approx(0.9)
    assert lines["compute cost"].predicted == pytest.approx(0.3) and lines["compute cost"].ratio == pytest.approx(1.0)
    assert lines["total cost"].predicted == pytest.approx(1.3) and lines["total cost"].actual == pytest.approx(1.2)
    unknown = {ln.label: ln for ln in forecast.against(
        made(600, None, 0.2, 0.1), forecast.Actual(wall_time_s=None, token_usd=0.9, compute_usd=0.3))}
    assert unknown["wall time"].ratio is None and unknown["token cost"].ratio is None  # not ended; not priced
    assert unknown["total cost"].predicted is None


def attempt(pg, run: str, pool: str, harness: str, dataset: str, n: int, calls: int, wall_s: float) -> None:
    t0 = datetime.now(UTC) - timedelta(hours=1)
    pg.execute("INSERT INTO runs (run, spec, spec_hash, backend, attempts) VALUES (%s, %s, 'h', 'local', %s)"
               " ON CONFLICT DO NOTHING",
               (run, Jsonb({"harness": {"name": harness}, "instances": {"dataset": dataset}}), n))
    for i in range(n):
        pg.execute("""INSERT INTO attempts (run, instance_id, attempt, harness, pool, model, outcome, status, calls,
                      wall_time_s, started_at) VALUES (%s, %s, 1, %s, %s, 'm', 'submitted', 'RESOLVED', %s, %s, %s)""",
                   (run, f"i{i}", harness, pool, calls, wall_s, t0))
        for seq in range(1, calls + 1):
            pg.execute("""INSERT INTO calls (call_id, run, instance_id, attempt, seq, pool, provider, model, route,
                          stream, started_at, input_tokens, cached_tokens, cache_write_tokens, output_tokens, cost_usd,
                          latency_ms, pacer_wait_ms, retries, http_status, outcome, usage_estimated)
                          VALUES (%s,%s,%s,1,%s,%s,'openai','m','/v1/chat/completions',false,%s,700,0,0,70,0,100,0,0,
                          200,'ok',false)""", (uuid.uuid4(), run, f"i{i}", seq, pool, t0))
    pg.commit()


class Spec:
    """What forecast.observation reads of a spec."""

    def __init__(self, pool: str, harness: str, dataset: str):
        self.pool = pool
        self.harness = type("H", (), {"name": harness})
        self.instances = type("I", (), {"dataset": dataset})


def test_the_ledger_is_the_pools_else_the_harness_on_the_dataset_else_the_prior(pg, unique):
    dataset = f"/data/{unique}.jsonl"
    attempt(pg, f"{unique}-a", f"{unique}-other-model@h", f"h-{unique}", dataset, n=3, calls=6, wall_s=90)
    attempt(pg, f"{unique}-b", f"{unique}-x@h", f"h-{unique}", "/data/another.jsonl", n=2, calls=50, wall_s=900)
    # the pool has no ledger: the harness's on this dataset (another model's), not its other dataset's
    obs = forecast.observation(pg, Spec(f"{unique}-new@h", f"h-{unique}", dataset))
    assert "other models (3 attempts)" in obs.basis, obs.basis
    assert obs.calls_per_attempt == 6 and obs.attempt_minutes == 1.5 and obs.input_per_call == 700
    # its own ledger first, once it has one
    attempt(pg, f"{unique}-c", f"{unique}-new@h", f"h-{unique}", dataset, n=1, calls=12, wall_s=60)
    own = forecast.observation(pg, Spec(f"{unique}-new@h", f"h-{unique}", dataset))
    assert own.basis == "ledger (1 attempts)" and own.calls_per_attempt == 12
    # a harness never seen on the dataset: the prior, said so
    assert forecast.observation(pg, Spec(f"{unique}-z@z", f"z-{unique}", dataset)).basis == "prior"
