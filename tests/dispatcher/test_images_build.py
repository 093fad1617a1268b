"""Building a spec's task images: at most `parallel` at once (and that many do run together), each problem kept to
its instance; the forecast of a spec's build time and registry bytes from the task images recorded so far."""

from __future__ import annotations

import threading

import psycopg
import pytest

from dispatcher import images


def stub_builds(monkeypatch, parallel: int, fail: str | None = None) -> dict:
    """ensure_task_images with its Docker parts replaced: each build waits until `parallel` of them are running."""
    seen = {"now": 0, "most": 0}
    lock = threading.Lock()
    together = threading.Barrier(parallel, timeout=30)  # a build that never meets the others breaks it: the test fails

    def build_task_image(client, conn, row, harness, runtime, base, *args, **kwargs):
        with lock:
            seen["now"] += 1
            seen["most"] = max(seen["most"], seen["now"])
        try:
            together.wait()
            if row["instance_id"] == fail:
                raise images.ImageProblem("no image")
            return images.TaskImage(row["instance_id"], harness, "inputs", "", "sha256:x", "sha256:x", base, "rt",
                                    2, 1, 1.0, own_bytes=1, built=True)
        finally:
            with lock:
                seen["now"] -= 1

    monkeypatch.setattr(images, "build_runtime", lambda client, harness, force=False: images.Runtime(
        "rt", "rt", "inputs", built=False, harness=harness))
    monkeypatch.setattr(images, "resolve_instance_image", lambda client, row, **kw: f"base-{row['instance_id']}")
    monkeypatch.setattr(images, "build_task_image", build_task_image)
    return seen


@pytest.mark.parametrize("parallel", [1, 3])
def test_task_images_build_parallel_at_a_time(monkeypatch, parallel):
    seen = stub_builds(monkeypatch, parallel, fail="i4")
    rows = [{"instance_id": f"i{n}", "base_commit": "c"} for n in range(6)]
    ready = []
    build = images.ensure_task_images(rows, "mini-swe-agent", conn=None, client=object(), parallel=parallel,
                                      on_image=lambda t: ready.append((t.instance_id, threading.current_thread())))
    assert seen["most"] == parallel
    assert set(build.images) == {r["instance_id"] for r in rows} - {"i4"} and list(build.problems) == ["i4"]
    assert sorted(i for i, _ in ready) == sorted(build.images)
    assert {thread for _, thread in ready} == {threading.current_thread()}  # callbacks never run on the pool
    assert build.parallel == parallel and len(build.built) == 5 and build.images_per_minute() > 0


def test_parallel_below_one_is_refused():
    with pytest.raises(ValueError, match="parallel"):
        images.ensure_task_images([], "mini-swe-agent", conn=None, client=object(), parallel=0)


def record(conn, iid: str, build_s: float, own: int | None, layer: int = 1000) -> None:
    images.record(conn, images.TaskImage(iid, "mini-swe-agent", "in-" + iid, "", "sha256:" + iid, "sha256:" + iid,
                                         "base", "rt", layer + 50, layer, build_s, own_bytes=own))


def test_forecast_of_a_spec_build_from_recorded_images(database_url):
    with psycopg.connect(database_url) as conn:
        conn.execute("DELETE FROM task_images WHERE harness = 'mini-swe-agent'")
        conn.commit()
        assert images.forecast_build(conn, "mini-swe-agent", 10, 4).build_s is None  # nothing to predict from
        record(conn, "old", 99.0, None)  # recorded before own bytes were kept: not a basis
        for iid, s, own in (("a", 10.0, 20), ("b", 30.0, 40), ("c", 20.0, 30)):
            record(conn, iid, s, own)
        f = images.forecast_build(conn, "mini-swe-agent", 10, 4)
    assert f.basis.startswith("3 recorded")
    assert f.build_s == 3 * 20.0  # 10 images, 4 at a time: 3 waves at the median build time
    assert (f.own_bytes, f.shared_bytes) == (30, 970) and f.registry_bytes == 970 + 10 * 30
