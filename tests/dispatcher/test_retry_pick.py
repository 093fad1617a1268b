"""Which attempts `retry` relaunches: the classes named (a status or an infrastructure class), never one whose retry
is pending, and no more than the run's remaining budget covers at the per-attempt cap."""

from __future__ import annotations

from dispatcher.retry import pick


def attempt(iid: str, status: str, error: str | None = None, replaced: bool = False) -> dict:
    return {"instance_id": iid, "attempt": 1, "slot": 1, "status": status, "error": error, "report": None,
            "replaced": replaced}


CURRENT = [attempt("a", "INFRA_ERROR", "lost_result: no row"), attempt("b", "RESOLVED"),
           attempt("c", "INFRA_ERROR", "rate_limited: refused"), attempt("d", "EVAL_ERROR"),
           attempt("e", "INFRA_ERROR", "setup failed: clone", replaced=True)]


def test_a_class_or_a_status_picks_its_attempts_and_a_pending_retry_is_not_repeated():
    assert [p[0] for p in pick(CURRENT, {"infra_error"}, 1.0, None)[0]] == ["a", "c"]
    assert pick(CURRENT, {"rate_limited"}, 1.0, None) == ([("c", 1, 1, "rate_limited")], 0)
    assert pick(CURRENT, {"eval_error", "lost_result"}, 1.0, None)[0] == [("a", 1, 1, "lost_result"),
                                                                         ("d", 1, 1, "eval_error")]


def test_only_as_many_as_the_remaining_budget_covers():
    assert pick(CURRENT, {"infra_error"}, 0.3, 0.25) == ([("a", 1, 1, "lost_result")], 1)
    assert pick(CURRENT, {"infra_error"}, 0.5, 0.25)[1] == 0
    assert pick(CURRENT, {"infra_error"}, 0.0, None) == ([], 2)  # spent: nothing, even without a per-attempt cap
