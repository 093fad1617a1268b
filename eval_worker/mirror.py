"""Copy instance images into a private registry and record each one's digest (table image_mirrors).

For every distinct `image` of the rows: take the local image, or pull it from its source registry
where that is reachable; tag it <registry>/<name without tag>:<tag>, push, read the manifest digest
from the push, and record (image, registry, repository, digest, image id) in PostgreSQL. Grading with
that registry configured then pulls <repository>@<digest> only (eval_worker.pinning).
"""

from __future__ import annotations

import logging

import docker

from eval_worker.records import MirrorRecord, record_mirror

log = logging.getLogger("eval_worker.mirror")


class MirrorError(RuntimeError):
    pass


def split_name(image: str) -> tuple[str, str]:
    """("swebench/sweb.eval.x86_64.a_1776_b-1", "latest") from "swebench/sweb.eval.x86_64.a_1776_b-1:latest"."""
    if "@" in image:
        raise MirrorError(f"{image}: already a digest reference")
    name, sep, tag = image.rpartition(":")
    if not sep or "/" in tag:
        return image, "latest"
    return name, tag


def _source_image(client: docker.DockerClient, image: str, pull: bool):
    try:
        return client.images.get(image)
    except docker.errors.ImageNotFound:
        if not pull:
            raise MirrorError(f"{image}: not present locally") from None
    try:
        log.info("pulling %s from its source", image)
        return client.images.pull(image)
    except docker.errors.DockerException as e:
        raise MirrorError(f"{image}: not present locally and the pull failed: {e}") from e


def push_image(client: docker.DockerClient, image: str, registry: str, pull: bool = True) -> MirrorRecord:
    src = _source_image(client, image, pull)
    name, tag = split_name(image)
    repository = f"{registry}/{name}"
    src.tag(repository, tag)
    digest = None
    try:
        for chunk in client.api.push(repository, tag=tag, stream=True, decode=True):
            if chunk.get("error"):
                raise MirrorError(f"{image}: push to {repository}:{tag} failed: {chunk['error']}")
            aux = chunk.get("aux") or {}
            digest = aux.get("Digest", digest)
    except docker.errors.DockerException as e:
        raise MirrorError(f"{image}: push to {repository}:{tag} failed: {e}") from e
    finally:
        client.images.remove(f"{repository}:{tag}", noprune=True)  # keep only the source name locally
    if not digest:
        raise MirrorError(f"{image}: the registry returned no digest")
    return MirrorRecord(image=image, registry=registry, repository=repository, digest=digest, image_id=src.id)


def mirror(rows: list[dict], registry: str, conn, *, client: docker.DockerClient | None = None,
           pull: bool = True) -> tuple[list[MirrorRecord], list[str]]:
    """Mirror and record each distinct image of `rows`. Returns (records, errors)."""
    client = client or docker.from_env()
    done, errors = [], []
    for image in dict.fromkeys(r["image"] for r in rows):
        try:
            rec = push_image(client, image, registry, pull=pull)
        except MirrorError as e:
            log.error("%s", e)
            errors.append(str(e))
            continue
        record_mirror(conn, rec)
        done.append(rec)
        log.info("mirrored %s -> %s", image, rec.ref)
    return done, errors
