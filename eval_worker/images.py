"""Build SWE-bench-shaped instance images for instances whose official image cannot be pulled here.

Each image is named exactly as the instance's `image` field (swebench/sweb.eval.x86_64.<...>:latest)
and built from images/swebench/Dockerfile on a local base older than the official images' Ubuntu 22.04
(default evalplane/debian:bullseye, glibc 2.31, made by scripts/docker.sh with debootstrap): conda's
layout at /opt/miniconda3 with the env `testbed` built from the (repo, version) recipe in the
repositories folder's environments.toml (eval_worker.environments) with the base's own Python, and
/testbed an unpruned clone (later history, tags, remote) reset to base_commit and installed. No registry
is needed at build time: the recipe's wheels are downloaded on the host (containers here cannot reach
the package index) for the base's Python version, and baked in as the env's offline wheelhouse.

An image is rebuilt only when its inputs (template, recipe, wheels, repository bundle, base commit, base
image) changed: they are hashed into its label org.evalplane.inputs.

`broken="no-pytest"` builds a deliberately broken variant (the env lacks pytest) so that gold validation
and grading have an environment that cannot run the tests.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import docker

from eval_worker.environments import (
    RECIPES_FILE,
    TEMPLATE_DIR,
    EnvironmentRecipe,
    GradingEnvironmentError,
    RecipeBook,
    wheelhouse,
)

log = logging.getLogger("eval_worker.images")

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_BASE = "evalplane/debian:bullseye"
BROKEN_MODES = {"no-pytest": ("pytest",)}  # mode -> packages left out of the recipe
LABEL = "org.evalplane.instance_id"
INPUTS_LABEL = "org.evalplane.inputs"
CONTEXT_FILES = ("Dockerfile", "testbed-env.sh", "conda", "bin")  # from TEMPLATE_DIR


def local_image_id_or_none(client: docker.DockerClient, name: str) -> str | None:
    try:
        return client.images.get(name).id
    except docker.errors.ImageNotFound:
        return None


def repo_bundle(row: dict, repos_dir: str | Path) -> Path:
    """The repository source for a row: <repos_dir>/<owner>__<name>.bundle (examples/synthetic layout)."""
    return Path(repos_dir) / f"{row['repo'].replace('/', '__')}.bundle"


def recipe_for(row: dict, repos_dir: str | Path) -> EnvironmentRecipe:
    """The row's (repo, version) recipe from <repos_dir>/environments.toml."""
    path = Path(repos_dir) / RECIPES_FILE
    if not path.is_file():
        raise GradingEnvironmentError(f"no {RECIPES_FILE} in {repos_dir}: it says how to build each (repo, version)'s "
                                      "environment (see docs/grading.md)")
    recipe = RecipeBook.load(path).get(row["repo"], row["version"])
    if recipe is None:
        raise GradingEnvironmentError(f"{path}: no recipe for {row['repo']} version {row['version']} "
                                      f"({row['instance_id']})")
    return recipe


def ensure_base(client: docker.DockerClient, base: str) -> str:
    """The base image's id; an evalplane/debian:<release> base is built (scripts/docker.sh) when missing."""
    image_id = local_image_id_or_none(client, base)
    if image_id is None and base.startswith("evalplane/debian:"):
        r = subprocess.run([str(ROOT / "scripts" / "docker.sh"), "base", base.split(":", 1)[1]],
                           capture_output=True, text=True, check=False, stdin=subprocess.DEVNULL)
        if r.returncode != 0:
            raise RuntimeError(f"building the base image {base} failed: {r.stderr.strip()[-2000:]}")
        image_id = local_image_id_or_none(client, base)
    if image_id is None:
        raise RuntimeError(f"base image {base} not found (never pulled: no public registry is assumed)")
    return image_id


_BASE_PYTHON: dict[str, str] = {}


def base_python(client: docker.DockerClient, base_id: str) -> str:
    """X.Y.Z of the base image's python3 (the testbed env's interpreter)."""
    if base_id not in _BASE_PYTHON:
        out = client.containers.run(base_id, ["python3", "-c", "import sys; print('%d.%d.%d' % sys.version_info[:3])"],
                                    remove=True)
        _BASE_PYTHON[base_id] = out.decode().strip()
    return _BASE_PYTHON[base_id]


@dataclass(frozen=True)
class Built:
    instance_id: str
    image: str
    image_id: str
    built: bool  # False: it already existed with the same inputs and was kept


def _inputs_digest(*, row: dict, bundle: Path, wheels: Path, packages: list[str], recipe: EnvironmentRecipe,
                   base_id: str, repo_url: str) -> str:
    h = hashlib.sha256()
    for name in CONTEXT_FILES:
        p = TEMPLATE_DIR / name
        for f in sorted([p] if p.is_file() else [x for x in p.rglob("*") if x.is_file()]):
            h.update(str(f.relative_to(TEMPLATE_DIR)).encode() + b"\0" + f.read_bytes() + b"\0")
    h.update(json.dumps({"base": base_id, "commit": row["base_commit"], "packages": packages,
                         "install": recipe.install, "url": repo_url,
                         "wheels": sorted(p.name for p in wheels.glob("*.whl"))}).encode())
    h.update(hashlib.sha256(bundle.read_bytes()).digest())
    return h.hexdigest()


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
    """Build the instance image for one row, named row["image"] unless `tag` is given.

    An existing image with the same inputs is kept unless force. broken: one of BROKEN_MODES, or None.
    wheels: a wheelhouse to use instead of the recipe's (tests).
    """
    client = client or docker.from_env()
    name = tag or row["image"]
    if broken is not None and broken not in BROKEN_MODES:
        raise ValueError(f"unknown broken mode {broken!r}; choose from {sorted(BROKEN_MODES)}")
    bundle = repo_bundle(row, repos_dir)
    if not bundle.is_file():
        raise FileNotFoundError(f"no repository bundle for {row['repo']}: {bundle}")
    recipe = recipe_for(row, repos_dir)
    base_id = ensure_base(client, base)
    python = base_python(client, base_id)
    if not recipe.admits(python):
        raise GradingEnvironmentError(f"{row['instance_id']}: the base {base} has Python {python}, outside "
                                      f"{row['repo']} {row['version']}'s python {recipe.python!r}")
    wheels = wheels or wheelhouse(recipe.packages + recipe.build, python)
    packages = recipe.requirements(drop=BROKEN_MODES.get(broken, ()))
    repo_url = f"https://github.invalid/{row['repo']}.git"  # a remote that never resolves
    inputs = _inputs_digest(row=row, bundle=bundle, wheels=wheels, packages=packages, recipe=recipe,
                            base_id=base_id, repo_url=repo_url)
    if not force:
        try:
            existing = client.images.get(name)
            if (existing.labels or {}).get(INPUTS_LABEL) == inputs:
                return Built(row["instance_id"], name, existing.id, built=False)
            log.info("%s: inputs changed, rebuilding", name)
        except docker.errors.ImageNotFound:
            pass
    with tempfile.TemporaryDirectory(prefix="ep-image-") as tmp:
        ctx = Path(tmp)
        for item in CONTEXT_FILES:
            src = TEMPLATE_DIR / item
            (shutil.copytree if src.is_dir() else shutil.copy)(src, ctx / item)
        shutil.copytree(wheels, ctx / "wheels", ignore=shutil.ignore_patterns(".complete"))
        shutil.copy(bundle, ctx / "repo.bundle")
        buildargs = {
            "BASE_IMAGE": base,
            "BASE_COMMIT": row["base_commit"],
            "PACKAGES": " ".join(packages),
            "REPO_URL": repo_url,
            "INSTALL": recipe.install,
        }
        labels = {LABEL: row["instance_id"], "org.evalplane.base_commit": row["base_commit"], INPUTS_LABEL: inputs}
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


def without_wheelhouse(client: docker.DockerClient, image: str, tag: str) -> str:
    """`image` without its baked wheelhouse and the pip configuration that keeps pip on it: its eval script's
    `pip install -e .` then fetches its build requirements from an index, as in the official images. Returns the
    image id (built once per image)."""
    source = client.images.get(image)
    try:
        existing = client.images.get(tag)
        if (existing.labels or {}).get("org.evalplane.from") == source.id:
            return existing.id
    except docker.errors.ImageNotFound:
        pass
    dockerfile = (f"FROM {source.id}\nRUN rm -rf /opt/wheelhouse /opt/miniconda3/envs/testbed/pip.conf\n"
                  f"LABEL org.evalplane.from={source.id} org.evalplane.wheelhouse=none\n")
    with tempfile.TemporaryDirectory(prefix="ep-image-") as tmp:
        (Path(tmp) / "Dockerfile").write_text(dockerfile)
        built, _ = client.images.build(path=tmp, tag=tag, rm=True, forcerm=True, pull=False)
    return built.id


def build_images(
    rows: list[dict],
    *,
    repos_dir: str | Path,
    client: docker.DockerClient | None = None,
    base: str = DEFAULT_BASE,
    force: bool = False,
) -> list[Built]:
    """Build (or keep) every row's image."""
    client = client or docker.from_env()
    return [build_image(r, repos_dir=repos_dir, client=client, base=base, force=force) for r in rows]


def load_rows(dataset: str | Path, instance_ids: list[str] | None = None) -> list[dict]:
    """Instance rows from a .json/.jsonl/.parquet dataset (swebench's own loader), optionally filtered."""
    from swebench.harness.utils import load_swebench_dataset

    return [dict(r) for r in load_swebench_dataset(str(dataset), "test", instance_ids or None)]


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="images/swebench/build.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--dataset", default=str(ROOT / "examples" / "synthetic" / "instances.jsonl"))
    ap.add_argument("--instances", nargs="*", default=None, help="instance ids (default: all)")
    ap.add_argument("--repos", default=None, help="folder of <owner>__<name>.bundle and environments.toml "
                                                  "(default: <dataset dir>/repos)")
    ap.add_argument("--base", default=DEFAULT_BASE, help=f"base image (default {DEFAULT_BASE})")
    ap.add_argument("--force", action="store_true", help="rebuild images even when their inputs did not change")
    ap.add_argument("--broken", choices=sorted(BROKEN_MODES), default=None,
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
    try:
        if args.tag or args.broken:
            out = [build_image(rows[0], repos_dir=repos, client=client, base=args.base, tag=args.tag,
                               force=args.force, broken=args.broken)]
        else:
            out = build_images(rows, repos_dir=repos, client=client, base=args.base, force=args.force)
    except (GradingEnvironmentError, FileNotFoundError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    for b in out:
        print(json.dumps({"instance_id": b.instance_id, "image": b.image, "image_id": b.image_id, "built": b.built}))
    return 0
