"""The SWE-bench-shaped instance images: what the official ones hold, looked at from inside each one
(no network), and rebuilt only when their inputs change."""

from __future__ import annotations

from ew_helpers import SYNTH

from eval_worker.images import INPUTS_LABEL, build_image

OFFICIAL_BASHRC_LINE = "source /opt/miniconda3/etc/profile.d/conda.sh && conda activate testbed"

# Run in each image with no network: facts as "key=value" lines.
FACTS = r"""
set -u
cd /testbed
echo "glibc=$(ldd --version | head -1 | awk '{print $NF}')"
echo "bashrc_last=$(tail -1 /root/.bashrc)"
echo "conda_files=$(ls /opt/miniconda3/bin/activate /opt/miniconda3/etc/profile.d/conda.sh | wc -l)"
echo "bash_env_python=$(BASH_ENV=/root/.bashrc bash -c 'command -v python')"
source /opt/miniconda3/bin/activate && conda activate testbed
echo "python=$(python -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
echo "pytest=$(python -m pytest --version 2>&1)"
echo "head=$(git rev-parse HEAD)"
echo "status=$(git status --porcelain | wc -l)"
echo "later=$(git rev-list --all --not HEAD | wc -l)"
echo "tags_before=$(git tag --merged HEAD | wc -l)"
echo "tags_after=$(git tag --no-merged HEAD | wc -l)"
echo "origin=$(git remote get-url origin)"
echo "origin_main_later=$(git merge-base --is-ancestor origin/main HEAD && echo no || echo yes)"
echo "installed_at=$(python -m pip show -f $PKG | grep -c __editable__)"
echo "version=$(python -c "import importlib.metadata as m; print(m.version('$PKG'))")"
[ -n "${FULL:-}" ] || exit 0
python -m pip install -q -e . >/dev/null 2>&1; echo "offline_reinstall=$?"
if [ "$PKG" = textkit ]; then
  git tag -l | xargs git tag -d >/dev/null
  python -m pip install -q -e . >/dev/null 2>&1
  pytest -rA tests/test_slug.py >/tmp/untagged.log 2>&1; echo "untagged_rc=$?"
  echo "untagged_refused=$(grep -c 'is not a tagged build' /tmp/untagged.log)"
fi
"""


def facts(client, image_id: str, package: str, full: bool) -> dict[str, str]:
    """full: also reinstall offline and try an untagged build (slower; once per repository)."""
    env = {"PKG": package, **({"FULL": "1"} if full else {})}
    out = client.containers.run(image_id, ["bash", "-c", FACTS], environment=env, network_mode="none",
                                remove=True).decode()
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def test_instance_images_are_swebench_shaped_and_unpruned(eval_images, docker_client, instances):
    seen = set()
    for iid, row in instances.items():
        package = row["repo"].split("/")[1]
        full = package not in seen
        seen.add(package)
        f = facts(docker_client, eval_images[iid], package, full)
        assert f["glibc"] == "2.31", f  # bullseye: older than the official images' Ubuntu 22.04 (2.35)
        assert f["bashrc_last"] == OFFICIAL_BASHRC_LINE and f["conda_files"] == "2", f
        assert f["bash_env_python"] == "/opt/miniconda3/envs/testbed/bin/python", f
        assert f["python"] == "3.9" and f["pytest"] == "pytest 8.4.2", f
        # /testbed: reset to the base commit, installed, NOT pruned (the task layer's job)
        assert f["head"] == row["base_commit"] and f["status"] == "0", f
        assert int(f["later"]) >= 1 and f["origin_main_later"] == "yes", f
        assert int(f["tags_before"]) >= 1 and int(f["tags_after"]) >= 1, f
        assert f["origin"] == f"https://github.invalid/{row['repo']}.git", f
        assert f["installed_at"] != "0", f
        assert f["version"].startswith(row["version"] + "."), f  # textkit: from the tags before the base
        if full:
            assert f["offline_reinstall"] == "0", f  # the eval script's `pip install -e .`, without a network
        if full and package == "textkit":
            assert f["untagged_rc"] == "4" and f["untagged_refused"] == "1", f  # every tag pruned: caught


def test_images_are_rebuilt_only_when_their_inputs_change(eval_images, docker_client, instances):
    row = instances["evalplane__calc-2"]
    again = build_image(row, repos_dir=SYNTH / "repos", client=docker_client)
    assert not again.built and again.image_id == eval_images[row["instance_id"]]
    labels = docker_client.images.get(row["image"]).labels
    assert len(labels[INPUTS_LABEL]) == 64 and labels["org.evalplane.instance_id"] == row["instance_id"]
    assert "org.evalplane.broken" not in labels
