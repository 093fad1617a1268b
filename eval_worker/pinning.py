"""Resolve an instance's image name to an immutable reference (by digest) before grading.

Order: a row whose `image` already carries "@sha256:" (pinned upstream, e.g. by the dispatcher) is
used as is; with a registry configured, only that registry's mirror record counts (grading then pulls
<repository>@<digest> and nothing else); otherwise the latest *valid* docker validation record gives
the image id that was validated. Without any record the local tag's image id is used, unless
require_pinned. Whatever is chosen becomes TestSpec.image, so the official run_instance sees a digest.
"""

from __future__ import annotations

from dataclasses import dataclass

import docker
import psycopg

from eval_worker import records
from eval_worker.images import local_image_id_or_none as local_image_id


class ImageUnavailable(RuntimeError):
    """The instance's image cannot be found or pinned: an infrastructure failure, never the model's."""


@dataclass(frozen=True)
class PinnedImage:
    ref: str  # "<repository>@sha256:<manifest>" or "sha256:<image id>"
    source: str  # row | mirror | validation | local


class ImageResolver:
    def __init__(self, database_url: str | None = None, registry: str | None = None, require_pinned: bool = False):
        self.database_url = database_url
        self.registry = registry
        self.require_pinned = require_pinned
        if registry and not database_url:
            raise ValueError("a registry needs a database with its mirror records")

    def resolve(self, client: docker.DockerClient, row: dict) -> PinnedImage:
        image, iid = row["image"], row["instance_id"]
        if "@sha256:" in image:
            return PinnedImage(image, "row")
        if self.database_url:
            try:
                with psycopg.connect(self.database_url, connect_timeout=10) as conn:
                    if self.registry:
                        m = records.mirror_record(conn, image, self.registry)
                        if m is None:
                            raise ImageUnavailable(f"{image} is not mirrored to {self.registry}")
                        return PinnedImage(m.ref, "mirror")
                    rec = records.validated(conn, [row])[iid]
            except psycopg.Error as e:
                raise ImageUnavailable(f"image records unavailable: {e}") from e
            if rec is not None and rec.valid:
                if local_image_id(client, rec.digest) is None:
                    raise ImageUnavailable(f"validated image {rec.digest} for {image} is not present")
                return PinnedImage(rec.digest, "validation")
        if self.require_pinned:
            raise ImageUnavailable(f"{image} has no valid validation or mirror record")
        image_id = local_image_id(client, image)
        if image_id is None:
            raise ImageUnavailable(f"image {image} not found locally (and not pinned: never pulled by tag)")
        return PinnedImage(image_id, "local")
