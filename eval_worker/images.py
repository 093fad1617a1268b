"""Build SWE-bench-shaped eval images for instances whose official image cannot be pulled here.

Each image is named exactly as the instance's `image` field (swebench/sweb.eval.x86_64.<...>:latest)
and built from images/swebench/Dockerfile on a local base (default evalplane/debian:bookworm, made by
scripts/docker.sh with debootstrap): the repository at /testbed at base_commit with later history
pruned, and a venv "testbed" with pytest behind a conda shim, so the official run_instance runs on it
unmodified. No registry is needed at build time: pytest's wheels are downloaded on the host (where
PyPI is reachable) and copied into the build context; containers here cannot reach PyPI's TLS.

`broken="no-pytest"` builds a deliberately broken variant (the env lacks pytest) so gold validation
has something to reject.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import docker

log = logging.getLogger("eval_worker.images")

ROOT = Path(__file__).resolve().parents[1]
TEMPLATE_DIR = ROOT / "images" / "swebench"
DEFAULT_BASE = "evalplane/debian:bookworm"
STATE_DIR = ROOT / ".state"
BROKEN_MODES = ("no-pytest",)
LABEL = "org.evalplane.instance_id"


def test_requirements() -> list[str]:
    """pytest pinned to the worker's own version, so docker and process backends run the same pytest."""
    return [f"pytest=={importlib.metadata.version('pytest')}"]


def wheelhouse(requirements: list[str], cache: Path | None = None) -> Path:
    """Wheels for `requirements` (and dependencies) downloaded on the host, cached by requirement set."""
    key = hashlib.sha256("\n".join(sorted(requirements)).encode()).hexdigest()[:16]
    d = (cache or STATE_DIR / "wheels") / key
    if (d / ".complete").exists():
        return d
    d.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "-d", str(d), "--only-binary=:all:",
         "--python-version", "3.11", "--implementation", "cp", "--platform", "manylinux2014_x86_64",
         *requirements],
        check=True, stdin=subprocess.DEVNULL,
    )
    (d / ".complete").write_text("\n".join(requirements) + "\n")
    return d


def local_image_id_or_none(client: docker.DockerClient, name: str) -> str | None:
    try:
        return client.images.get(name).id
    except docker.errors.ImageNotFound:
        return None


def repo_bundle(row: dict, repos_dir: str | Path) -> Path:
    """The repository source for a row: <repos_dir>/<owner>__<name>.bundle (examples/synthetic layout)."""
    return Path(repos_dir) / f"{row['repo'].replace('/', '__')}.bundle"


@dataclass(frozen=True)
class Built:
    instance_id: str
    image: str
    image_id: str
    built: bool  # False: it already existed and was kept


def build_image(
    row: dict,
    *,
    repos_dir: str | Path,
    client: docker.DockerClient | None = None,
    base: str = DEFAULT_BASE,
    tag: str | None = None,
    force: bool = False,
    broken: str | None = None,
    wheels: Path | None = None,
) -> Built:
    """Build the eval image for one instance row, named row["image"] unless `tag` is given.

    An existing image is kept unless force. broken: one of BROKEN_MODES, or None.
    """
    client = client or docker.from_env()
    name = tag or row["image"]
    if broken is not None and broken not in BROKEN_MODES:
        raise ValueError(f"unknown broken mode {broken!r}; choose from {BROKEN_MODES}")
    existing = None if force else local_image_id_or_none(client, name)
    if existing:
        return Built(row["instance_id"], name, existing, built=False)
    bundle = repo_bundle(row, repos_dir)
    if not bundle.is_file():
        raise FileNotFoundError(f"no repository bundle for {row['repo']}: {bundle}")
    requirements = test_requirements()
    wheels = wheels or wheelhouse(requirements)
    with tempfile.TemporaryDirectory(prefix="ep-image-") as tmp:
        ctx = Path(tmp)
        shutil.copy(TEMPLATE_DIR / "Dockerfile", ctx / "Dockerfile")
        shutil.copytree(TEMPLATE_DIR / "conda", ctx / "conda")
        shutil.copytree(TEMPLATE_DIR / "bin", ctx / "bin")
        shutil.copytree(wheels, ctx / "wheels", ignore=shutil.ignore_patterns(".complete"))
        shutil.copy(bundle, ctx / "repo.bundle")
        buildargs = {
            "BASE_IMAGE": base,
            "BASE_COMMIT": row["base_commit"],
            "PIP_PACKAGES": "" if broken == "no-pytest" else " ".join(requirements),
        }
        labels = {LABEL: row["instance_id"], "org.evalplane.base_commit": row["base_commit"]}
        if broken:
            labels["org.evalplane.broken"] = broken
        try:
            image, _ = client.images.build(
                path=str(ctx), tag=name, buildargs=buildargs, labels=labels, rm=True, forcerm=True, pull=False
            )
        except docker.errors.BuildError as e:
            lines = "".join(c.get("stream", "") or c.get("error", "") for c in e.build_log if isinstance(c, dict))
            raise RuntimeError(f"building {name} failed: {e}\n{lines[-4000:]}") from e
    log.info("built %s (%s)", name, image.id)
    return Built(row["instance_id"], name, image.id, built=True)


def build_images(
    rows: list[dict],
    *,
    repos_dir: str | Path,
    client: docker.DockerClient | None = None,
    base: str = DEFAULT_BASE,
    force: bool = False,
) -> list[Built]:
    """Build (or keep) every row's image; one wheelhouse for all."""
    client = client or docker.from_env()
    wheels = wheelhouse(test_requirements())
    return [build_image(r, repos_dir=repos_dir, client=client, base=base, force=force, wheels=wheels) for r in rows]


def load_rows(dataset: str | Path, instance_ids: list[str] | None = None) -> list[dict]:
    """Instance rows from a .json/.jsonl/.parquet dataset (swebench's own loader), optionally filtered."""
    from swebench.harness.utils import load_swebench_dataset

    return [dict(r) for r in load_swebench_dataset(str(dataset), "test", instance_ids or None)]


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="images/swebench/build.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--dataset", default=str(ROOT / "examples" / "synthetic" / "instances.jsonl"))
    ap.add_argument("--instances", nargs="*", default=None, help="instance ids (default: all)")
    ap.add_argument("--repos", default=None, help="folder of <owner>__<name>.bundle (default: <dataset dir>/repos)")
    ap.add_argument("--base", default=DEFAULT_BASE, help=f"base image (default {DEFAULT_BASE})")
    ap.add_argument("--force", action="store_true", help="rebuild images that already exist")
    ap.add_argument("--broken", choices=BROKEN_MODES, default=None,
                    help="build a deliberately broken image (needs --tag and exactly one instance)")
    ap.add_argument("--tag", default=None, help="image name instead of the row's `image` (one instance only)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    rows = load_rows(args.dataset, args.instances)
    repos = args.repos or str(Path(args.dataset).resolve().parent / "repos")
    if (args.tag or args.broken) and len(rows) != 1:
        ap.error("--tag/--broken need exactly one instance (--instances ID)")
    if args.broken and not args.tag:
        ap.error("--broken needs --tag (never shadow the official name with a broken image)")
    client = docker.from_env()
    if args.tag or args.broken:
        out = [build_image(rows[0], repos_dir=repos, client=client, base=args.base, tag=args.tag,
                           force=args.force, broken=args.broken)]
    else:
        out = build_images(rows, repos_dir=repos, client=client, base=args.base, force=args.force)
    for b in out:
        print(json.dumps({"instance_id": b.instance_id, "image": b.image, "image_id": b.image_id, "built": b.built}))
    return 0
