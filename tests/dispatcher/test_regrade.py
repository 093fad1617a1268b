"""`regrade --from-logs`: a finished run's recorded test output parsed again with swebench's own grading functions.

The run's verdicts are the official get_eval_report's over synthetic test logs (as a grader records them); parsed
again they come out the same; with a log parser that differs (a test double in swebench's parser registry) the new
verdicts are recorded beside the old, nothing is overwritten, and `report --gradings` says which changed.
"""

from __future__ import annotations

import json
from pathlib import Path

from psycopg.types.json import Jsonb
from swebench.harness.constants import END_TEST_OUTPUT, LOG_TEST_OUTPUT, START_TEST_OUTPUT
from swebench.harness.grading import get_eval_report
from swebench.harness.log_parsers import PARSER_REGISTRY
from swebench.harness.utils import make_test_spec

from contract import aws
from contract.models import AttemptRef
from dispatcher import cli, regrade, report
from dispatcher.backends import resources
from dispatcher.driver import loop as runmod
from dispatcher.plan import make_plan
from dispatcher.spec import load_spec
from tests.dispatcher.test_reaper import SYNTHETIC, spec_file


def names_of(row: dict) -> list[str]:
    return json.loads(row["FAIL_TO_PASS"]) + json.loads(row["PASS_TO_PASS"])


def eval_output(row: dict, failing: set[str]) -> str:
    """A pytest -rA test output between the official markers, as the eval script prints it."""
    lines = [f"{'FAILED' if t in failing else 'PASSED'} {t}" for t in names_of(row)]
    return "\n".join([f"+ : '{START_TEST_OUTPUT}'", *lines, f"+ : '{END_TEST_OUTPUT}'",
                      f">>>>> Test Exit Code: {1 if failing else 0}", ""])


def graded_run(tmp_path: Path, run: str, pg, failing: dict[str, set[str]]):
    """A run whose attempts were graded from the given test logs (each instance's failing tests), as a grader
    records them: the patch and test_output.txt in S3, the official report entry on the row."""
    plan = make_plan(load_spec(spec_file(tmp_path, run, 300, ids=sorted(failing))))
    runmod.open_run(pg, plan)
    res = resources.ensure(run)
    for iid, failed in failing.items():
        ref = AttemptRef(run=run, instance_id=iid, attempt=1)
        prefix = res.artifacts_prefix(ref)
        row = plan.rows[iid]
        aws.put_text(prefix + "patch.diff", row["patch"])
        log = tmp_path / f"{iid}.txt"
        log.write_text(eval_output(row, failed))
        aws.put_text(aws.eval_logs_prefix(prefix) + LOG_TEST_OUTPUT, log.read_text())
        pred = {"instance_id": iid, "model_name_or_path": "gpt-4o-mini", "model_patch": row["patch"]}
        entry = get_eval_report(make_test_spec(row), pred, str(log), include_tests_status=True)[iid]
        status = "RESOLVED" if entry["resolved"] else "UNRESOLVED"
        pg.execute("""INSERT INTO attempts (run, instance_id, attempt, harness, pool, model, outcome, status, patch_uri,
                                            patch_bytes, eval_outcome, resolved, report)
                      VALUES (%s, %s, 1, 'mini-swe-agent', 'p', 'gpt-4o-mini', 'submitted', %s, %s, %s, %s, %s, %s)""",
                   (run, iid, status, prefix + "patch.diff", len(row["patch"]), status.lower(), entry["resolved"],
                    Jsonb(entry)))
    pg.commit()
    return plan, res


def first_verdicts(pg, run: str) -> list[tuple]:
    got = pg.execute("SELECT instance_id, status, resolved, report FROM attempts WHERE run = %s ORDER BY 1",
                     (run,)).fetchall()
    pg.commit()
    return got


def test_regrade_from_logs_reproduces_then_records_a_differing_parsers_verdicts_beside_the_old(
        tmp_path, unique, pg, database_url, moto_endpoint, monkeypatch, capsys):
    resolved_one, unresolved_one = "evalplane__calc-1", "evalplane__calc-2"
    plan, res = graded_run(tmp_path, unique, pg, {
        resolved_one: set(), unresolved_one: {json.loads(_row(unresolved_one)["FAIL_TO_PASS"])[0]}})

    def prefix(ref: AttemptRef) -> str:
        return res.artifacts_prefix(ref)

    first = first_verdicts(pg, unique)
    assert [s for _, s, _, _ in first] == ["RESOLVED", "UNRESOLVED"]

    same = regrade.from_logs(pg, plan, prefix)
    assert [(r.ref.instance_id, r.before, r.after) for r in same] == [
        (resolved_one, "RESOLVED", "RESOLVED"), (unresolved_one, "UNRESOLVED", "UNRESOLVED")]
    assert regrade.changes(pg, unique) == []  # the same verdicts, reports and all
    reports = dict(pg.execute("SELECT instance_id, report FROM gradings WHERE run = %s", (unique,)).fetchall())
    assert reports == {iid: rep for iid, _, _, rep in first}

    official_parser = PARSER_REGISTRY["parse_log_pytest"]

    def first_fail_to_pass_fails(log: str, test_spec) -> dict[str, str]:  # the official one, but stricter
        return official_parser(log, test_spec) | {test_spec.FAIL_TO_PASS[0]: "FAILED"}

    monkeypatch.setitem(PARSER_REGISTRY, "parse_log_pytest", first_fail_to_pass_fails)
    differing = regrade.from_logs(pg, plan, prefix)
    assert [(r.ref.instance_id, r.after) for r in differing] == [(resolved_one, "UNRESOLVED"),
                                                                 (unresolved_one, "UNRESOLVED")]
    changed = regrade.changes(pg, unique)  # the one it failed already is unchanged, report and all
    assert [(c["instance_id"], c["first"], c["latest"], c["how"]) for c in changed] == [
        (resolved_one, "RESOLVED", "UNRESOLVED", "logs")]
    assert changed[0]["grader_version"].startswith("swebench ") and changed[0]["image_digest"] is None
    assert first_verdicts(pg, unique) == first  # no verdict overwritten
    assert pg.execute("SELECT count(*) FROM gradings WHERE run = %s", (unique,)).fetchone()[0] == 4

    # the official outputs and the report use the latest
    attempts = report.fetch_attempts(pg, unique)
    [_, official] = report.write_outputs(unique, attempts, list(plan.rows.values()), tmp_path / "out", 1,
                                         lambda iid, n: prefix(AttemptRef(run=unique, instance_id=iid, attempt=n)))
    got = json.loads(official.read_text())
    assert got["resolved_ids"] == [] and got["unresolved_ids"] == [resolved_one, unresolved_one]
    capsys.readouterr()
    assert cli.main(["report", unique, "--gradings"]) == 0
    shown = capsys.readouterr().out
    assert f"{resolved_one} attempt 1: RESOLVED -> UNRESOLVED (logs" in shown and unresolved_one not in shown


def _row(iid: str) -> dict:
    rows = {json.loads(line)["instance_id"]: json.loads(line)
            for line in (SYNTHETIC / "instances.jsonl").read_text().splitlines() if line.strip()}
    return rows[iid]
