"""A launcher and a grader kept outside the project, named by dotted path in the spec (backend.launcher,
eval.backend), run a real run: the recording launcher (tests/seams/recording.py) launches every attempt, the
recording grader grades every patch, and each attempt lands exactly one row, with the verdict the grader gave."""

from __future__ import annotations

import json
from pathlib import Path

import psycopg
import pytest
from test_local_run import SYNTHETIC, dispatcher, write_spec

from tests.seams.recording import GRADINGS, LAUNCHES

pytestmark = pytest.mark.e2e
INSTANCES = ("evalplane__calc-2", "evalplane__textkit-1")


def test_a_launcher_and_a_grader_named_by_dotted_path_run_a_run(tmp_path, env, database_url, unique):
    spec = write_spec(tmp_path, unique, gateway=False)
    text = spec.read_text()
    text = text.replace(f'repos = "{SYNTHETIC}/repos"',
                        f'repos = "{SYNTHETIC}/repos"\nids = {json.dumps(list(INSTANCES))}')
    text = text.replace('kind = "local"', 'kind = "local"\nlauncher = "tests.seams.recording:RecordingLauncher"')
    text = text.replace("[eval]", '[eval]\nbackend = "tests.seams.recording:RecordingGrader"')
    text = text.replace("attempts = 1", "attempts = 2")
    spec.write_text(text)

    p = dispatcher(env, "run", str(spec), "--out", str(tmp_path / "out"))
    assert p.returncode == 0, p.stderr[-4000:]

    refs = {(i, n) for i in INSTANCES for n in (1, 2)}
    launches = [json.loads(line) for line in
                (Path(env["EVALPLANE_STATE_DIR"]) / "runs" / unique / LAUNCHES).read_text().splitlines()]
    assert sorted((x["instance_id"], x["attempt"]) for x in launches) == sorted(refs)  # each once, through it
    with psycopg.connect(database_url) as conn:
        rows = conn.execute("SELECT instance_id, attempt, count(*), min(status) FROM attempts WHERE run = %s"
                            " GROUP BY instance_id, attempt", (unique,)).fetchall()
        stored = conn.execute("SELECT spec -> 'backend' ->> 'launcher', spec -> 'eval' ->> 'backend' FROM runs"
                              " WHERE run = %s", (unique,)).fetchone()
    assert {(i, a): n for i, a, n, _ in rows} == dict.fromkeys(refs, 1)
    assert stored == ("tests.seams.recording:RecordingLauncher", "tests.seams.recording:RecordingGrader")
    gradings = [json.loads(line) for line in
                (Path(env["EVALPLANE_STATE_DIR"]) / "runs" / unique / GRADINGS).read_text().splitlines()]
    assert sorted((x["instance_id"], x["attempt"]) for x in gradings) == sorted(refs)  # every patch, by it
    assert {(i, a): s for i, a, _, s in rows} == {  # each row carries the verdict the grader gave
        (x["instance_id"], x["attempt"]): "RESOLVED" if x["resolved"] else "UNRESOLVED" for x in gradings}
