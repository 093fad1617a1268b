"""Task images: what each attempt runs in. `python -m dispatcher images spec.toml` builds what a spec needs.

A task image is the instance's own image (the official `swebench/sweb.eval.*` image or its mirror, by digest; for
tests and the demo, the SWE-bench-shaped stand-ins eval_worker.images builds) with three layers on top:

  1. the runtime's packages under contract.task_shape.RUNTIME_PREFIX: its own CPython built on bullseye and the
     packages of the task runner and the shim (images/task/Dockerfile.runtime, built once per Python and pins and
     shared by every harness). Nothing goes into the instance's environment, and its Python version does not matter;
  2. the harness under RUNTIME_PREFIX/harness/<name>, from the harness layer image (images/task/harness/<name>/
     Dockerfile, FROM the runtime's packages; harness/adapters/base.py describes the layout);
  3. the project's own code (the task runner, the shim, the adapters) under RUNTIME_PREFIX/app
     (images/task/Dockerfile.app: the runtime base, the packages with the code). A change to the code rebuilds only
     this thin layer, never the two below it;
  4. /testbed pruned at the base commit (harness/prune_history.sh): no later commit, branch, tag, remote or reflog.
     Empty when the instance image is already pruned, as the official ones are.

Layers 1-3 are byte-identical in every task image that uses them (the same digests), so a registry stores them once
and each further task image adds only its layer 4. They are copied from layer images (FROM scratch, holding only
the runtime's, the harness's or the code's folder, built once per inputs): copying a whole root onto the instance
sets every folder's metadata, /opt's included, from that one image, where copying a folder into the instance would
leave /opt with the time of each build. Task images of a spec are built `parallel` at a time ([images] build_parallel).

Each image is keyed by its inputs (the instance image's digest, the runtime's sources and requirements, the harness
layer's inputs, the recipe): an image whose inputs did not change is reused, never rebuilt. Built images are pushed to the
registry the spec names (`[images] registry`; on AWS the estate's ECR) and recorded in PostgreSQL (task_images),
so launchers run them by digest.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path

import docker
import docker.errors
import psycopg

from contract import task_shape

log = logging.getLogger("evalplane.images")

ROOT = Path(__file__).resolve().parents[1]
TASK_DIR = ROOT / "images" / "task"
RUNTIME_PACKAGES = ("contract", "plumbing", "harness", "shim")  # what the runtime carries of this project
RUNTIME_PYTHON = "3.11.2"  # Debian bookworm's python3.11 source package, which Dockerfile.runtime builds
RUNTIME_REPOSITORY = "evalplane/task-runtime"
HARNESS_REPOSITORY = "evalplane/task-harness"
TASK_REPOSITORY = "evalplane/task"
LAYER_REPOSITORY = "evalplane/task-layer"
WHEEL_PLATFORMS = ("manylinux2014_x86_64", "manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "linux_x86_64", "any")


class ImageProblem(Exception):
    """One instance's task image cannot be made; the message says what is missing."""


@dataclass(frozen=True)
class Runtime:
    """A harness layer image (the runtime's packages plus one harness) and the runtime base (the packages plus the
    project's code): what a task image copies its runtime from."""

    tag: str
    image_id: str
    inputs: str  # the base's and the harness layer's inputs together
    built: bool
    build_s: float = 0.0  # the harness layer's build (the base's is base_build_s)
    base_tag: str = ""
    base_built: bool = False
    base_build_s: float = 0.0
    base_bytes: int = 0
    layer_bytes: int = 0  # what the harness layer adds to the runtime's packages
    harness: str = ""
    runtime_layer: str = ""  # the layer images task images copy from, in order (tags; see layer_image)
    harness_layer: str = ""
    app_layer: str = ""
    shared_bytes: int = 0  # the three layers every task image of this runtime shares

    @property
    def layers(self) -> tuple[str, str, str]:
        return self.runtime_layer, self.harness_layer, self.app_layer


@dataclass(frozen=True)
class TaskImage:
    instance_id: str
    harness: str
    inputs: str
    registry: str  # "" = the local engine only
    ref: str  # what launchers run: <registry>/<repository>@sha256:... or the local image id
    image_id: str
    instance_image: str
    runtime_image: str
    size_bytes: int
    layer_bytes: int
    build_s: float
    own_bytes: int | None = None  # what no other task image of its harness shares (None: recorded before it was kept)
    built: bool = False  # built now (False: reused)


def _sha(*parts: bytes | str) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p.encode() if isinstance(p, str) else p)
        h.update(b"\0")
    return h.hexdigest()


PACKAGES_RECIPE = "Dockerfile.runtime"
PACKAGES_FILES = (PACKAGES_RECIPE, "collect_libs.sh", "requirements.txt")


def _app_files() -> list[Path]:
    """The project's code the runtime carries (images/task/Dockerfile.app puts it under RUNTIME_PREFIX/app)."""
    files = [TASK_DIR / "Dockerfile.app"]
    for pkg in RUNTIME_PACKAGES:
        files += sorted(p for p in (ROOT / pkg).rglob("*") if p.is_file() and "__pycache__" not in p.parts
                        and p.suffix in (".py", ".sh", ".sql", ".json", ".yaml"))
    return files


def _name(requirement: str) -> str:
    m = re.match(r"\s*([A-Za-z0-9_.-]+)", requirement)
    return re.sub(r"[-_.]+", "-", m.group(1)).lower() if m else ""


def _constraints() -> str:
    """The pins of requirements.lock the runtime's requirements reach (the runtime installs the same versions the
    project is tested with): from its `# via` notes, a pin is kept if a kept package or the runtime itself needs it,
    so that a pin of the project's own tooling (a test plugin) does not change the runtime's inputs."""
    pins: dict[str, str] = {}
    needed_by: dict[str, set[str]] = {}
    current = ""
    for line in (ROOT / "requirements.lock").read_text().splitlines():
        if re.match(r"^[A-Za-z0-9_.-]+(\[[^]]*\])?==", line):
            current = _name(line)
            pins[current], needed_by[current] = line, set()
        elif current and (m := re.match(r"^\s+#\s+(?:via\s+)?(?!via\s*$)([A-Za-z0-9_.-]+)\s*$", line)):
            needed_by[current].add(_name(m.group(1)))
    reqs = (TASK_DIR / "requirements.txt").read_text().splitlines()
    kept = {_name(r) for r in reqs if r.strip() and not r.lstrip().startswith("#")}
    while grown := {p for p, by in needed_by.items() if p not in kept and by & kept}:
        kept |= grown
    return "".join(pins[p] + "\n" for p in sorted(pins) if p in kept)


def _files_sha(*head: str, files: list[Path]) -> str:
    parts: list[bytes | str] = list(head)
    for f in files:
        parts += [str(f.relative_to(ROOT)), f.read_bytes()]
    return _sha(*parts)


def packages_inputs() -> str:
    """Everything the runtime's packages image is made of (its Python, the pins, the recipe), hashed: no Docker needed
    to know whether it changed."""
    return _files_sha(RUNTIME_PYTHON, _constraints(), files=[TASK_DIR / n for n in PACKAGES_FILES])


def base_inputs() -> str:
    """The runtime base's: the packages' inputs and the project's code."""
    return _files_sha(packages_inputs(), files=_app_files())


def harness_inputs(harness: str) -> str:
    """A harness layer's: the packages it is built on (never the project's code) and the adapter's layer inputs."""
    from harness.adapters import load_adapter

    return _sha(packages_inputs(), harness, load_adapter(harness).layer_inputs())


def runtime_inputs(harness: str) -> str:
    """The runtime base's inputs with the harness layer's: what a task image's runtime part is made of."""
    return _sha(base_inputs(), harness_inputs(harness))


def _wheels(dest: Path) -> None:
    """The runtime's wheels, downloaded on this host (containers here reach no package index over TLS), once per
    set of requirements and pins."""
    key = _sha(_constraints(), (TASK_DIR / "requirements.txt").read_text(), RUNTIME_PYTHON)[:16]
    cache = ROOT / ".state" / "wheels" / f"task-runtime-{key}"
    if not (cache / ".complete").exists():
        cache.mkdir(parents=True, exist_ok=True)
        plat = [a for p in WHEEL_PLATFORMS for a in ("--platform", p)]
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--only-binary=:all:", "--python-version",
                        RUNTIME_PYTHON, *plat, "-c", str(dest.parent / "constraints.txt"), "-r",
                        str(TASK_DIR / "requirements.txt"), "pip", "-d", str(cache)],
                       check=True, stdin=subprocess.DEVNULL)
        (cache / ".complete").touch()
    shutil.copytree(cache, dest, ignore=shutil.ignore_patterns(".complete"))


def _build(client: docker.DockerClient, ctx: Path, tag: str, dockerfile: str, buildargs: dict, labels: dict):
    try:
        image, _ = client.images.build(path=str(ctx), dockerfile=dockerfile, tag=tag, buildargs=buildargs,
                                       labels=labels, rm=True, forcerm=True, pull=False)
        return image
    except docker.errors.BuildError as e:
        lines = "".join(c.get("stream", "") or c.get("error", "") for c in e.build_log if isinstance(c, dict))
        raise ImageProblem(f"building {tag} failed: {e}\n{lines[-3000:]}") from e


def _image_id(client: docker.DockerClient, name: str) -> str | None:
    try:
        return client.images.get(name).id
    except docker.errors.ImageNotFound:
        return None


# which checkout built an image: a checkout cleans up only its own older builds, never those of another checkout (or
# branch) sharing the engine, whose inputs differ and whose runs may be using them
CHECKOUT_LABEL = f"{task_shape.LABEL_PREFIX}.checkout"
CHECKOUT = hashlib.sha256(str(ROOT).encode()).hexdigest()[:12]


def _remove_superseded(client: docker.DockerClient, labels: dict[str, str], keep: str) -> None:
    """Older builds of the same thing by this checkout (same labels, other inputs) leave the local engine: a host
    that builds every day would otherwise fill its disk. An image a container still uses stays."""
    labels = labels | {CHECKOUT_LABEL: CHECKOUT}
    for image in client.images.list(filters={"label": [f"{k}={v}" for k, v in labels.items()]}):
        if image.id != keep:
            try:
                client.images.remove(image.id, force=False, noprune=False)
            except docker.errors.APIError:
                pass


def _tag_part(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)[:80]


def _runtime_image(client: docker.DockerClient, kind: str, inputs: str, dockerfile: str,
                   fill: Callable[[Path], None], buildargs: dict, force: bool) -> tuple[str, str, bool, float]:
    """One image of the runtime (`kind`), built once per inputs from `dockerfile` in a context `fill` completes.
    Returns (tag, image id, built now, build seconds)."""
    tag = f"{RUNTIME_REPOSITORY}:{kind}-{inputs[:16]}"
    if not force and (found := _image_id(client, tag)):
        return tag, found, False, 0.0
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="ep-runtime-") as tmp:
        ctx = Path(tmp)
        shutil.copy(TASK_DIR / dockerfile, ctx / dockerfile)
        fill(ctx)
        image = _build(client, ctx, tag, dockerfile, buildargs | {"PREFIX": task_shape.RUNTIME_PREFIX},
                       {f"{task_shape.LABEL_PREFIX}.runtime_inputs": inputs,
                        f"{task_shape.LABEL_PREFIX}.runtime": kind, CHECKOUT_LABEL: CHECKOUT})
    _remove_superseded(client, {f"{task_shape.LABEL_PREFIX}.runtime": kind}, image.id)
    build_s = time.monotonic() - t0
    log.info("built the runtime's %s %s in %.0f s (%.0f MB)", kind, tag, build_s, image.attrs["Size"] / 1e6)
    return tag, image.id, True, build_s


def build_packages(client: docker.DockerClient, force: bool = False) -> tuple[str, str, bool, float]:
    """The runtime's packages image (the CPython stage is cached by Docker)."""
    def fill(ctx: Path) -> None:
        for name in PACKAGES_FILES:
            if name != PACKAGES_RECIPE:  # _runtime_image copies the recipe
                shutil.copy(TASK_DIR / name, ctx / name)
        (ctx / "constraints.txt").write_text(_constraints())
        _wheels(ctx / "wheels")

    return _runtime_image(client, "packages", packages_inputs(), PACKAGES_RECIPE, fill, {}, force)


def build_base(client: docker.DockerClient, force: bool = False) -> tuple[str, str, bool, float]:
    """The runtime base image: the runtime's packages with the project's code (build seconds: the packages'
    included where they were built now)."""
    packages_tag, _, _, packages_s = build_packages(client)

    def fill(ctx: Path) -> None:
        for f in _app_files():
            rel = f.relative_to(ROOT)
            if rel.parts[0] in RUNTIME_PACKAGES:
                (ctx / "src" / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(f, ctx / "src" / rel)

    tag, image_id, built, build_s = _runtime_image(client, "base", base_inputs(), "Dockerfile.app", fill,
                                                   {"PACKAGES_IMAGE": packages_tag}, force)
    return tag, image_id, built, build_s + packages_s


def build_runtime(client: docker.DockerClient, harness: str, force: bool = False) -> Runtime:
    """The runtime's packages with `harness`'s layer on them, the runtime base (the packages with the project's code)
    and the layer images task images copy (each built once per inputs). `force` rebuilds the harness layer and the
    layer images and, if their inputs changed, the packages and the base (Docker's cache keeps the CPython stage)."""
    from harness.adapters import load_adapter

    adapter = load_adapter(harness)
    base_tag, base_id, base_built, base_s = build_base(client, force=False)
    packages_tag = build_packages(client)[0]  # build_base made it: this only finds it
    layer_inputs = harness_inputs(harness)
    tag = f"{HARNESS_REPOSITORY}:{_tag_part(harness)}-{layer_inputs[:16]}"
    base_bytes = client.images.get(base_id).attrs["Size"]
    found = None if force else _image_id(client, tag)
    built, t0 = found is None, time.monotonic()
    if built:
        with tempfile.TemporaryDirectory(prefix="ep-harness-") as tmp:
            ctx = Path(tmp) / "ctx"
            shutil.copytree(adapter.layer_dir(), ctx)
            adapter.prepare_layer(ctx)
            label = {f"{task_shape.LABEL_PREFIX}.harness_layer": _tag_part(harness)}
            image = _build(client, ctx, tag, "Dockerfile",
                           {"RUNTIME_IMAGE": packages_tag, "PREFIX": task_shape.RUNTIME_PREFIX},
                           label | {f"{task_shape.LABEL_PREFIX}.runtime_inputs": layer_inputs,
                                    CHECKOUT_LABEL: CHECKOUT})
        _remove_superseded(client, label, image.id)
        found = image.id
    layer_bytes = client.images.get(found).attrs["Size"] - client.images.get(packages_tag).attrs["Size"]
    runtime_layer = layer_image(client, packages_tag, task_shape.RUNTIME_PREFIX, "runtime", packages_inputs(), force)
    harness_layer = layer_image(client, tag, str(adapter.install_dir()), _tag_part(harness), layer_inputs, force)
    app_layer = layer_image(client, base_tag, f"{task_shape.RUNTIME_PREFIX}/app", "app", base_inputs(), force)
    shared = sum(client.images.get(t).attrs["Size"] for t in (runtime_layer, harness_layer, app_layer))
    runtime = Runtime(tag, found, runtime_inputs(harness), built=built,
                      build_s=round(time.monotonic() - t0, 1) if built else 0.0,
                      base_tag=base_tag, base_built=base_built, base_build_s=round(base_s, 1), base_bytes=base_bytes,
                      layer_bytes=layer_bytes, harness=harness, runtime_layer=runtime_layer,
                      harness_layer=harness_layer, app_layer=app_layer, shared_bytes=shared)
    log.info("harness layer %s %s: %s, %.0f MB on the runtime's packages %s; runtime base %s (%.0f MB)", harness,
             adapter.version, f"built in {runtime.build_s:.1f} s" if built else "reused", layer_bytes / 1e6,
             packages_tag, base_tag, base_bytes / 1e6)
    return runtime


LAYER_DOCKERFILE = """ARG SOURCE
FROM ${SOURCE} AS source
FROM scratch
ARG DIR
COPY --from=source ${DIR} ${DIR}
"""


def layer_image(client: docker.DockerClient, source: str, folder: str, kind: str, inputs: str,
                force: bool = False) -> str:
    """An image FROM scratch holding only `folder` of `source` (built once per inputs): what every task image copies
    that folder from, so the layer it makes is the same bytes on every instance. Returns its tag."""
    tag = f"{LAYER_REPOSITORY}:{kind}-{inputs[:16]}"
    if not force and _image_id(client, tag):
        return tag
    label = {f"{task_shape.LABEL_PREFIX}.task_layer": kind}
    with tempfile.TemporaryDirectory(prefix="ep-layer-") as tmp:
        (Path(tmp) / "Dockerfile").write_text(LAYER_DOCKERFILE)
        image = _build(client, Path(tmp), tag, "Dockerfile", {"SOURCE": source, "DIR": folder},
                       label | {f"{task_shape.LABEL_PREFIX}.runtime_inputs": inputs, CHECKOUT_LABEL: CHECKOUT})
    _remove_superseded(client, label, image.id)
    return tag


def task_dockerfile() -> str:
    """The task image's recipe: FROM the instance image, the layer images of the runtime's packages, the harness and
    the project's code copied in whole (each one layer, the same bytes on every instance), /testbed pruned."""
    p = task_shape.RUNTIME_PREFIX
    return "\n".join([
        "ARG RUNTIME_LAYER",
        "ARG HARNESS_LAYER",
        "ARG APP_LAYER",
        "ARG INSTANCE_IMAGE",
        "FROM ${RUNTIME_LAYER} AS runtime",
        "FROM ${HARNESS_LAYER} AS harness",
        "FROM ${APP_LAYER} AS app",
        "FROM ${INSTANCE_IMAGE}",
        "ARG BASE_COMMIT",
        "COPY --from=runtime / /",
        "COPY --from=harness / /",
        "COPY --from=app / /",
        f'RUN test -n "$BASE_COMMIT" && {p}/bin/prune-history {task_shape.TESTBED} "$BASE_COMMIT"',
        f"ENTRYPOINT {json.dumps(task_shape.ENTRYPOINT)}",
        "CMD []",
        "",
    ])


def task_inputs(runtime: Runtime, instance_image: str, row: dict) -> str:
    return _sha(runtime.inputs, instance_image, row["base_commit"], task_dockerfile())


def task_tag(instance_id: str, harness: str, inputs: str, repository: str = TASK_REPOSITORY) -> str:
    """<repository>:<harness>.<instance>.<inputs>; a tag allows [A-Za-z0-9_.-], at most 128 of them."""
    iid = re.sub(r"[^A-Za-z0-9_.-]", "_", instance_id)
    return f"{repository}:" + f"{harness}.{iid[:100]}.{inputs[:12]}"[:128]


# ------------------------------------------------------------------------------ records

_COLS = ("instance_id", "harness", "inputs", "registry", "ref", "image_id", "instance_image", "runtime_image",
         "size_bytes", "layer_bytes", "build_s", "own_bytes")


def record(conn: psycopg.Connection, t: TaskImage) -> None:
    row = {k: v for k, v in asdict(t).items() if k in _COLS}
    conn.execute(
        f"INSERT INTO task_images ({', '.join(_COLS)}) VALUES ({', '.join(['%s'] * len(_COLS))}) "
        "ON CONFLICT (instance_id, harness, inputs, registry) DO UPDATE SET "
        + ", ".join(f"{c} = EXCLUDED.{c}" for c in _COLS[4:]) + ", built_at = now()",
        [row[c] for c in _COLS])
    conn.commit()


def recorded(conn: psycopg.Connection, instance_id: str, harness: str, inputs: str, registry: str) -> TaskImage | None:
    r = conn.execute(f"SELECT {', '.join(_COLS)} FROM task_images WHERE instance_id = %s AND harness = %s"
                     " AND inputs = %s AND registry = %s", (instance_id, harness, inputs, registry)).fetchone()
    conn.commit()
    return TaskImage(**dict(zip(_COLS, r))) if r else None


def latest(conn: psycopg.Connection, instance_ids: list[str], harness: str, registry: str) -> dict[str, TaskImage]:
    """Each instance's newest recorded task image (what a run uses where it cannot compute inputs itself)."""
    rows = conn.execute(
        f"SELECT DISTINCT ON (instance_id) {', '.join(_COLS)} FROM task_images WHERE instance_id = ANY(%s)"
        " AND harness = %s AND registry = %s ORDER BY instance_id, built_at DESC",
        (instance_ids, harness, registry)).fetchall()
    conn.commit()
    return {r[0]: TaskImage(**dict(zip(_COLS, r))) for r in rows}


@dataclass(frozen=True)
class BuildForecast:
    """What building a spec's task images takes, from the task images of its harness recorded so far."""

    images: int
    parallel: int
    basis: str
    build_s: float | None = None  # None: nothing recorded to predict from
    registry_bytes: int | None = None
    shared_bytes: int = 0
    own_bytes: int = 0


def forecast_build(conn: psycopg.Connection, harness: str, n_images: int, parallel: int) -> BuildForecast:
    """Waves of `parallel` builds at the median recorded build time; the shared layers once plus each image's own
    bytes (uncompressed: a registry keeps layers gzipped, so it stores at most this)."""
    row = conn.execute(
        "SELECT count(*), percentile_cont(0.5) WITHIN GROUP (ORDER BY build_s),"
        " percentile_cont(0.5) WITHIN GROUP (ORDER BY own_bytes),"
        " percentile_cont(0.5) WITHIN GROUP (ORDER BY layer_bytes - own_bytes)"
        " FROM task_images WHERE harness = %s AND own_bytes IS NOT NULL", (harness,)).fetchone()
    conn.commit()
    if not row[0]:
        return BuildForecast(n_images, parallel, f"no task image of {harness} recorded yet")
    own, shared = int(row[2]), int(row[3])
    return BuildForecast(n_images, parallel, f"{row[0]} recorded task image(s) of {harness}",
                         build_s=-(-n_images // parallel) * float(row[1]), registry_bytes=shared + n_images * own,
                         shared_bytes=shared, own_bytes=own)


# ------------------------------------------------------------------------------ building


def _present(client: docker.DockerClient, t: TaskImage) -> bool:
    """Still runnable: in the registry (by digest) or, without one, in the local engine."""
    try:
        if t.registry:
            client.images.get_registry_data(t.ref)
        else:
            client.images.get(t.ref)
        return True
    except docker.errors.NotFound:
        return False
    except docker.errors.APIError as e:  # the registry does not answer: not evidence the image is gone
        raise ImageProblem(f"registry {t.registry} unreachable: {e}") from e


def _from_ref(client: docker.DockerClient, ref: str) -> str:
    """A name FROM accepts for an instance image pinned by local image id (FROM takes no bare id)."""
    if not ref.startswith("sha256:"):
        return ref
    name = f"evalplane/instance-pinned:{ref.split(':', 1)[1][:32]}"
    client.images.get(ref).tag(name)
    return name


def build_task_image(client: docker.DockerClient, conn: psycopg.Connection, row: dict, harness: str,
                     runtime: Runtime, instance_image: str, registry: str = "", force: bool = False,
                     repository: str = TASK_REPOSITORY, db_lock: threading.Lock | None = None) -> TaskImage:
    """The task image of one instance: reused when its inputs are recorded and the image is still there. `db_lock`
    serialises the use of `conn` where several of these run at once."""
    db = db_lock or nullcontext()
    iid = row["instance_id"]
    inputs = task_inputs(runtime, instance_image, row)
    with db:
        rec = recorded(conn, iid, harness, inputs, registry)
    if rec is not None and not force and _present(client, rec):
        return rec
    tag = task_tag(iid, harness, inputs, repository)
    t0 = time.monotonic()
    existing = None if force else _image_id(client, tag)  # built for these inputs by another database's run
    if existing:
        image = client.images.get(existing)
    else:
        with tempfile.TemporaryDirectory(prefix="ep-task-") as tmp:
            (Path(tmp) / "Dockerfile").write_text(task_dockerfile())
            image = _build(client, Path(tmp), tag, "Dockerfile", {
                "RUNTIME_LAYER": runtime.runtime_layer, "HARNESS_LAYER": runtime.harness_layer,
                "APP_LAYER": runtime.app_layer,
                "INSTANCE_IMAGE": _from_ref(client, instance_image), "BASE_COMMIT": row["base_commit"]}, {
                f"{task_shape.LABEL_PREFIX}.instance_id": iid, f"{task_shape.LABEL_PREFIX}.harness": harness,
                f"{task_shape.LABEL_PREFIX}.task_inputs": inputs, CHECKOUT_LABEL: CHECKOUT})
        _remove_superseded(client, {f"{task_shape.LABEL_PREFIX}.instance_id": iid,
                                    f"{task_shape.LABEL_PREFIX}.harness": harness}, image.id)
    build_s = time.monotonic() - t0
    layer_bytes = image.attrs["Size"] - client.images.get(instance_image).attrs["Size"]
    ref = image.id
    if registry:
        from eval_worker.mirror import MirrorError, push_image

        try:
            ref = push_image(client, tag, registry, pull=False).ref
        except MirrorError as e:
            raise ImageProblem(str(e)) from e
    t = TaskImage(iid, harness, inputs, registry, ref, image.id, instance_image, runtime.image_id,
                  image.attrs["Size"], layer_bytes, round(build_s, 3),
                  own_bytes=max(layer_bytes - runtime.shared_bytes, 0), built=not existing)
    with db:
        record(conn, t)
    log.info("%s %s (%s) in %.1f s", "recorded" if existing else "built", tag, ref, build_s)
    return t


def resolve_instance_image(client: docker.DockerClient, row: dict, *, database_url: str | None,
                           instance_registry: str | None, repos_dir: str | None) -> str:
    """The instance's image by digest (mirror record, validation record, or the local image's id). Where a
    repository bundle is at hand and no official image is (none in the local engine, or only a stand-in of ours),
    the SWE-bench-shaped stand-in is built from it (eval_worker.images: kept while its inputs are unchanged)."""
    from eval_worker.environments import GradingEnvironmentError
    from eval_worker.images import INPUTS_LABEL, build_image, repo_bundle
    from eval_worker.pinning import ImageResolver, ImageUnavailable

    if not instance_registry and repos_dir and repo_bundle(row, repos_dir).is_file():
        local = _image_id(client, row["image"])
        if local is None or INPUTS_LABEL in (client.images.get(local).labels or {}):
            try:
                build_image(row, repos_dir=repos_dir, client=client)
            except (GradingEnvironmentError, RuntimeError) as e:
                raise ImageProblem(f"no image for {row['instance_id']}: its stand-in could not be built: {e}") from e
    try:
        return ImageResolver(database_url, instance_registry).resolve(client, row).ref
    except ImageUnavailable as e:
        where = f"mirrored to {instance_registry}" if instance_registry else "in the local engine"
        raise ImageProblem(f"no image for {row['instance_id']}: {row['image']} is not {where} ({e}); mirror the "
                           "official image (python -m eval_worker mirror) or name [images] instance_registry") from None


@dataclass
class Build:
    """What building a spec's task images did: the images and problems by instance id, and how long the task
    images took (the runtime and harness layer images before them not counted) at how many at once."""

    images: dict[str, TaskImage] = field(default_factory=dict)
    problems: dict[str, str] = field(default_factory=dict)
    runtime: Runtime | None = None
    parallel: int = 1
    seconds: float = 0.0

    @property
    def built(self) -> list[TaskImage]:
        return [t for t in self.images.values() if t.built]

    def images_per_minute(self) -> float | None:
        return len(self.built) * 60 / self.seconds if self.built and self.seconds > 0 else None


def ensure_task_images(rows: list[dict], harness: str, conn: psycopg.Connection, *, registry: str = "",
                       repository: str = TASK_REPOSITORY, instance_registry: str | None = None,
                       repos_dir: str | None = None,
                       database_url: str | None = None, force: bool = False,
                       client: docker.DockerClient | None = None, parallel: int = 1,
                       on_image: Callable[[TaskImage], None] | None = None) -> Build:
    """Every row's task image, built where missing, `parallel` at a time (the runtime and harness layers first, once).
    `on_image` is called from this thread as each is ready."""
    if parallel < 1:
        raise ValueError(f"parallel must be at least 1, not {parallel}")
    client = client or docker.from_env(timeout=600, max_pool_size=parallel + 2)
    runtime = build_runtime(client, harness, force=force)
    out = Build(runtime=runtime, parallel=parallel)
    db_lock = threading.Lock()

    def one(row: dict) -> TaskImage:
        base = resolve_instance_image(client, row, database_url=database_url, instance_registry=instance_registry,
                                      repos_dir=repos_dir)
        return build_task_image(client, conn, row, harness, runtime, base, registry, force, repository, db_lock)

    t0 = time.monotonic()
    with ThreadPoolExecutor(max_workers=parallel, thread_name_prefix="task-image") as pool:
        futures = {pool.submit(one, row): row["instance_id"] for row in rows}
        for done in as_completed(futures):
            iid = futures[done]
            try:
                out.images[iid] = done.result()
            except ImageProblem as e:
                out.problems[iid] = str(e)
                continue
            if on_image:
                on_image(out.images[iid])
    out.seconds = time.monotonic() - t0
    return out


# ------------------------------------------------------------------------------ a spec's images


@dataclass(frozen=True)
class Target:
    """Where a spec's task images go: a registry (and repository), or the local engine only."""

    registry: str
    repository: str
    instance_registry: str | None


def target(spec) -> Target:
    """The spec's registry, or on AWS the estate's ECR repository (the build tier pushes there): its backend's say."""
    from dispatcher import backends

    return backends.for_spec(spec).image_target()


def build_for_plan(plan, conn: psycopg.Connection, *, force: bool = False, parallel: int | None = None,
                   on_image: Callable[[TaskImage], None] | None = None) -> Build:
    """Build (or reuse) the plan's task images, `parallel` at a time (default: the spec's [images] build_parallel)."""
    from contract import db

    spec, t = plan.spec, target(plan.spec)
    return ensure_task_images(list(plan.rows.values()), spec.harness.name, conn, registry=t.registry,
                              repository=t.repository, instance_registry=t.instance_registry,
                              repos_dir=spec.instances.repos, database_url=db.database_url(), force=force,
                              parallel=parallel or spec.images.build_parallel, on_image=on_image)


def for_plan(plan, conn: psycopg.Connection, *, build: bool, force: bool = False,
             on_image: Callable[[TaskImage], None] | None = None) -> tuple[dict[str, TaskImage], dict[str, str]]:
    """The plan's task images, by instance id, and what is missing for the others. build=False only looks them up
    (AWS runs: the build tier built them; `validate`): an image counts where its current inputs are recorded."""
    spec, rows = plan.spec, list(plan.rows.values())
    t = target(spec)
    if build:
        done = build_for_plan(plan, conn, force=force, on_image=on_image)
        return done.images, done.problems
    from eval_worker import records

    runtime = Runtime(tag="", image_id="", inputs=runtime_inputs(spec.harness.name), built=False)
    images: dict[str, TaskImage] = {}
    problems: dict[str, str] = {}
    for row in rows:
        iid = row["instance_id"]
        base = row["image"] if "@sha256:" in row["image"] else None
        if base is None and t.instance_registry:
            m = records.mirror_record(conn, row["image"], t.instance_registry)
            base = m.ref if m else None
        if base is None:
            problems[iid] = (f"no image: {row['image']} is not mirrored to {t.instance_registry}"
                             if t.instance_registry else f"no image: {row['image']} is not pinned by digest and "
                             "[images] instance_registry is not set")
            continue
        rec = recorded(conn, iid, spec.harness.name, task_inputs(runtime, base, row), t.registry)
        if rec is None:
            problems[iid] = (f"no task image in {t.registry or 'the local engine'} for these inputs: build it with "
                             "`python -m dispatcher images SPEC` (on AWS, on the build tier)")
            continue
        images[iid] = rec
    return images, problems
