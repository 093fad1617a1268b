"""The driver's reaper: a task that died without a result is landed as infra_error, exactly once; a task that
sent its result is never reaped, however far behind the writer is."""

from pathlib import Path

from contract import aws, keys
from contract.models import AttemptRef, Envelope
from dispatcher import resources, run as runmod
from dispatcher.launchers.base import TaskHandle
from dispatcher.plan import make_plan
from dispatcher.spec import load_spec

ROOT = Path(__file__).resolve().parents[2]


class ExitedLauncher:
    """Tasks that have already exited with the given codes."""

    def __init__(self, codes: dict[str, int]):
        self.codes = codes

    def poll(self, handle: TaskHandle) -> int | None:
        return self.codes[handle.ref.instance_id]


def test_reaper_lands_only_tasks_that_died_without_a_result(moto_endpoint, valkey, unique, pg, monkeypatch):
    monkeypatch.setattr(runmod, "REAP_GRACE_S", 0.0)
    plan = make_plan(load_spec(ROOT / "examples" / "local.toml"))
    res = resources.ensure(unique)
    crashed, finished, marked, silent = (AttemptRef(run=unique, instance_id=i, attempt=1) for i in (
        "evalplane__calc-1", "evalplane__calc-2", "evalplane__textkit-1", "evalplane__textkit-2"))
    launcher = ExitedLauncher({crashed.instance_id: -9, finished.instance_id: 0, marked.instance_id: 1,
                               silent.instance_id: 0})  # silent: exit 0 but never marked done (never ran)
    valkey.hset(keys.progress(finished), mapping={"phase": "done"})  # its result is on the queue
    valkey.hset(keys.progress(marked), mapping={"phase": "done"})  # it sent its result, then failed
    loop = runmod.DriverLoop(plan, res, pg, valkey, launcher, None, None)
    for ref in (crashed, finished, marked, silent):
        loop.running[ref] = runmod.Running(handle=TaskHandle(ref=ref, task_id=ref.instance_id), started=0.0)
    loop._reap({}, now=100.0)
    loop._reap({}, now=200.0)  # a second pass sends nothing more
    got = aws.client("sqs").receive_message(QueueUrl=res.results_queue_url, MaxNumberOfMessages=10)
    msgs = [Envelope.model_validate_json(m["Body"]).msg for m in got.get("Messages", [])]
    got_ids = sorted((m.ref.instance_id, m.outcome.value) for m in msgs)
    assert got_ids == [("evalplane__calc-1", "infra_error"), ("evalplane__textkit-2", "infra_error")]
    assert any("code -9" in m.error for m in msgs)
    valkey.delete(keys.progress(marked), keys.progress(finished))
    resources.remove_queues(res)
