"""History pruned at the base commit: after harness/prune_history.sh nothing later is reachable in any way git
offers (refs, remotes, reflogs, stashes, notes, loose or packed objects, alternates), tags before the base stay,
and the working tree is untouched. The checks here are written independently of the script's own."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from contract.models import AttemptLimits, AttemptRef, HarnessRef, Job, ModelRef
from harness.task import SetupFailed, checkout, prune_history

ENV = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.invalid", "GIT_COMMITTER_NAME": "t",
       "GIT_COMMITTER_EMAIL": "t@example.invalid", "GIT_CONFIG_GLOBAL": "/dev/null", "PATH": "/usr/bin:/bin"}


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=repo, env=ENV, check=True, capture_output=True, text=True).stdout


def commit(repo: Path, name: str, tag: str | None = None, annotated: bool = False) -> str:
    (repo / name).write_text(name + "\n")
    git(repo, "add", name)
    git(repo, "commit", "-qm", f"add {name}")
    if tag:
        git(repo, "tag", *(["-a", "-m", tag] if annotated else []), tag)
    return git(repo, "rev-parse", "HEAD").strip()


@pytest.fixture
def upstream(tmp_path) -> tuple[Path, str, list[str]]:
    """An upstream with tags before and after the base commit, a side branch and notes past it."""
    up = tmp_path / "upstream"
    up.mkdir()
    git(up, "init", "-q", "-b", "main")
    commit(up, "a", "v0.1", annotated=True)
    base = commit(up, "b", "v0.2")
    future = [commit(up, "fix", "v0.3", annotated=True), commit(up, "later")]
    git(up, "notes", "add", "-m", "a note on the future", "HEAD")
    git(up, "checkout", "-q", "-b", "feature", base)
    future.append(commit(up, "side", "v9-side"))
    git(up, "checkout", "-q", "main")
    return up, base, future


def all_objects(repo: Path) -> dict[str, str]:
    out = git(repo, "cat-file", "--batch-all-objects", "--batch-check=%(objectname) %(objecttype)")
    return dict(line.split() for line in out.splitlines())


def assert_pruned(repo: Path, base: str, future: list[str]) -> None:
    objects = all_objects(repo)
    for sha, kind in objects.items():
        if kind == "commit":
            r = subprocess.run(["git", "merge-base", "--is-ancestor", sha, base], cwd=repo, env=ENV, check=False)
            assert r.returncode == 0, f"commit {sha} is not the base commit or before it"
    assert not set(future) & set(objects), "a later commit is still in the object store"
    refs = git(repo, "for-each-ref", "--format=%(refname)").split()
    assert all(r.startswith(("refs/tags/", "refs/heads/")) for r in refs), refs
    assert git(repo, "remote").strip() == ""
    assert git(repo, "stash", "list").strip() == ""
    assert set(git(repo, "log", "--all", "--format=%H").split()) == set(git(repo, "log", "--format=%H", base).split())
    assert git(repo, "reflog", "--all").strip() == "" if (repo / ".git" / "logs").exists() else True
    for f in ("FETCH_HEAD", "ORIG_HEAD", "objects/info/alternates"):
        assert not (repo / ".git" / f).exists(), f


def test_a_clone_with_remote_stash_notes_and_reflog_keeps_nothing_after_the_base(upstream, tmp_path):
    up, base, future = upstream
    work = tmp_path / "work"
    git(tmp_path, "clone", "-q", str(up), str(work))
    git(work, "fetch", "-q", "origin", "refs/notes/*:refs/notes/*")
    git(work, "checkout", "-q", "--detach", base)
    (work / "a").write_text("stashed\n")
    git(work, "stash", "-q")
    (work / "b").write_text("the image's setup left this\n")
    git(work, "replace", future[1], base)  # a replace ref, naming a later commit
    assert len(git(work, "for-each-ref", "--format=%(refname)").split()) >= 8  # remote, notes, stash, replace, tags
    prune_history(work, base)
    assert_pruned(work, base, future)
    assert sorted(git(work, "tag").split()) == ["v0.1", "v0.2"]  # the tags before the base stay
    assert git(work, "describe", "--tags").strip() == "v0.2"  # what setuptools_scm reads
    assert (work / "b").read_text() == "the image's setup left this\n"  # the working tree is never touched
    prune_history(work, base)  # a pruned repository passes as it is
    assert_pruned(work, base, future)


def test_alternates_are_made_the_repositorys_own(upstream, tmp_path):
    up, base, future = upstream
    work = tmp_path / "shared"
    git(tmp_path, "clone", "-q", "--shared", str(up), str(work))
    git(work, "checkout", "-q", "--detach", base)
    prune_history(work, base)
    assert_pruned(work, base, future)
    assert git(work, "fsck", "--full").strip() == ""  # every object it needs is its own


def test_a_head_past_the_base_that_changes_files_is_refused(upstream, tmp_path):
    up, base, _future = upstream
    work = tmp_path / "ahead"
    git(tmp_path, "clone", "-q", str(up), str(work))
    with pytest.raises(SetupFailed, match="past the base commit"):
        prune_history(work, base)
    with pytest.raises(SetupFailed, match="not in"):
        prune_history(work, "0" * 40)


def test_an_empty_commit_on_the_base_is_kept(upstream, tmp_path):
    """The official image builder may commit nothing on top of the base: that is not the repository's future."""
    up, base, future = upstream
    work = tmp_path / "empty"
    git(tmp_path, "clone", "-q", str(up), str(work))
    git(work, "checkout", "-q", "--detach", base)
    git(work, "commit", "-q", "--allow-empty", "-m", "SWE-bench")
    prune_history(work, base)
    assert_pruned(work, git(work, "rev-parse", "HEAD").strip(), future)


def job_for(bundle: Path, base: str) -> Job:
    return Job(ref=AttemptRef(run="r", instance_id="o__r-1", attempt=1), harness=HarnessRef(name="mini-swe-agent"),
               model=ModelRef(provider="openai", model="m", pool="p"), limits=AttemptLimits(),
               instance={"base_commit": base}, repo_source=str(bundle), upstream_url="http://x.invalid",
               results_queue_url="http://x.invalid/q", artifacts_prefix="s3://b/p/", valkey_url="redis://x.invalid")


def test_the_process_launchers_checkout_of_a_whole_bundle_is_pruned(upstream, tmp_path):
    """A user's bundle carries the upstream's whole history, the fix among it: the agent's checkout does not."""
    up, base, future = upstream
    bundle = tmp_path / "o__r.bundle"
    git(up, "bundle", "create", "-q", str(bundle), "--all")
    testbed = tmp_path / "testbed"
    checkout(job_for(bundle, base), testbed)
    assert_pruned(testbed, base, future)
    assert git(testbed, "rev-parse", "HEAD").strip() == base
    with pytest.raises(SetupFailed, match="f{40}"):  # a base commit the bundle lacks: no attempt, an infra error
        checkout(job_for(bundle, "f" * 40), tmp_path / "missing")
