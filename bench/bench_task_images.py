#!/usr/bin/env python3
"""What the Nth task image of a spec adds: to a registry (bytes, from the registry's own storage) and to a node that
already holds its instance image and the task images before it (bytes, from the layers' chain identities).

    .venv/bin/python bench/bench_task_images.py [--spec examples/local.toml] [--count 10]

A registry of its own on loopback (scripts/registry.sh, storage in a temporary folder) and a PostgreSQL database of
its own (dropped at the end). Each instance image is pushed first, as the mirror would hold it; then the task images
are built and pushed one at a time (dispatcher.images), the registry's storage measured after each. Where the spec
has fewer instances than --count, the next images are of copies of its instances: the same instance image with a
label of its own (a new image, no new layer), so each copy's task image has its own pruned /testbed layer, as
another instance's would.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import os
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import docker
import psycopg

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from contract import db
from dispatcher import images
from dispatcher.cli.target import load_plan
from eval_worker.mirror import push_image

BASE_DB = os.environ.get("DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/test")


def registry_script(verb: str, port: str, state: Path) -> str:
    return subprocess.run([str(ROOT / "scripts/registry.sh"), verb, port], capture_output=True, text=True, check=True,
                          env=os.environ | {"EVALPLANE_STATE_DIR": str(state)}).stdout.strip()


def copy_of(client: docker.DockerClient, row: dict, k: int) -> dict:
    """Instance `row` again under another id, its image the same layers with a label of its own."""
    tag = f"evalplane/bench-instance:{row['instance_id']}-copy{k}"
    dockerfile = f"FROM {row['image']}\nLABEL evalplane.bench.copy={k}\n"
    client.images.build(fileobj=io.BytesIO(dockerfile.encode()), tag=tag, rm=True, pull=False)
    return row | {"instance_id": f"{row['instance_id']}.copy{k}", "image": tag}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--spec", default=str(ROOT / "examples" / "local.toml"))
    ap.add_argument("--count", type=int, default=10)
    args = ap.parse_args()
    os.chdir(ROOT)  # the example specs name their dataset relative to the checkout
    plan = load_plan(args.spec)
    harness, rows = plan.spec.harness.name, list(plan.rows.values())
    client = docker.from_env(timeout=900)
    name = f"ep_bench_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(BASE_DB, autocommit=True) as c:
        c.execute(f'CREATE DATABASE "{name}"')
    db_url = BASE_DB.rsplit("/", 1)[0] + "/" + name
    port = str(20000 + uuid.uuid4().int % 20000)
    with tempfile.TemporaryDirectory(prefix="ep-bench-registry-") as state:
        registry = registry_script("up", port, Path(state))
        try:
            with psycopg.connect(db_url) as conn:
                db.migrate(conn)
                run(client, conn, db_url, registry, harness, rows, args.count, plan.spec.instances.repos,
                    lambda: int(registry_script("du", port, Path(state))))
        finally:
            registry_script("down", port, Path(state))
            with psycopg.connect(BASE_DB, autocommit=True) as c:
                c.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def run(client, conn, db_url, registry, harness, rows, count, repos, stored) -> None:
    bases = {r["instance_id"]: images.resolve_instance_image(client, r, database_url=db_url, instance_registry=None,
                                                             repos_dir=repos) for r in rows}
    todo = [rows[i % len(rows)] if i < len(rows) else copy_of(client, rows[i % len(rows)], i // len(rows))
            for i in range(count)]
    for r in todo:
        push_image(client, r["image"], registry, pull=False)
    made = []
    print(f"harness {harness}, registry {registry}: {stored()} bytes stored before any task image "
          f"({len(todo)} instance image(s) mirrored)")
    print(f"{'n':>3} {'instance':<32} {'registry +bytes':>16} {'own bytes':>12} {'node +bytes':>12}")
    for n, r in enumerate(todo, 1):
        before = stored()
        build = images.ensure_task_images([r], harness, conn, registry=registry, client=client,
                                          repos_dir=repos if r["instance_id"] in bases else None)
        if build.problems:
            raise SystemExit(f"{r['instance_id']}: {build.problems}")
        t = build.images[r["instance_id"]]
        made.append((n, r["instance_id"], stored() - before, t))
    unique = node_bytes(client, made, build.runtime)
    for n, iid, added, t in made:
        print(f"{n:>3} {iid:<32} {added:>16} {t.own_bytes:>12} {unique[t.image_id]:>12}")
    rt = build.runtime
    print(f"layer images of the runtime's packages {rt.runtime_layer}, the harness {rt.harness_layer}, the code "
          f"{rt.app_layer}: "
          f"{rt.shared_bytes} bytes uncompressed, shared")
    for *_, t in made:  # the copies leave the engine: nothing runs them
        if t.instance_id not in bases:
            client.images.remove(t.image_id, force=True)
            client.images.remove(t.instance_image, force=True)


def chain_ids(diff_ids: list[str]) -> list[str]:
    """The engine's identity of each layer: its content and every layer below it (the OCI image spec's ChainID)."""
    out: list[str] = []
    for d in diff_ids:
        out.append(d if not out else "sha256:" + hashlib.sha256(f"{out[-1]} {d}".encode()).hexdigest())
    return out


def node_bytes(client, made: list, runtime) -> dict[str, int]:
    """What each task image adds to an engine that holds its instance image and every task image before it: the
    layers whose chain it does not hold yet (an engine stores, and pulls, a layer once per chain, not per content)."""
    held: set[str] = set()
    added = {}
    for *_, t in made:
        layers = client.images.get(t.image_id).attrs["RootFS"]["Layers"]
        base = client.images.get(t.instance_image).attrs["RootFS"]["Layers"]
        held |= set(chain_ids(base))
        sizes = [client.images.get(tag).attrs["Size"] for tag in runtime.layers] + [t.own_bytes]
        added[t.image_id] = sum(sizes[i - len(base)] for i, c in enumerate(chain_ids(layers)) if c not in held)
        held |= set(chain_ids(layers))
    return added


if __name__ == "__main__":
    main()
