"""PostgreSQL records for eval images (tables from contract/migrations/0002_image_validations.sql).

ValidationRecord: gold validation of one instance on one image digest. MirrorRecord: one image copied
into a private registry, by manifest digest. Queries take an open psycopg connection and commit.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime
from typing import Any

import psycopg
from psycopg.types.json import Jsonb
from pydantic import BaseModel, ConfigDict, Field

from contract.models import utcnow
from eval_worker.graders import Grader, grader_name


class ValidationRecord(BaseModel):
    model_config = ConfigDict(frozen=True)

    image: str
    digest: str  # docker image id (sha256:...) for the docker grader; "process:sha256:..." otherwise
    instance_id: str
    backend: str = "docker"  # the grader's name (registered, or its dotted path)
    valid: bool
    reason: str | None = None
    details: dict[str, Any] = Field(default_factory=dict)
    validated_at: datetime = Field(default_factory=utcnow)


class MirrorRecord(BaseModel):
    model_config = ConfigDict(frozen=True)

    image: str
    registry: str
    repository: str
    digest: str  # manifest digest in the registry
    image_id: str  # config digest (docker image id)
    mirrored_at: datetime = Field(default_factory=utcnow)

    @property
    def ref(self) -> str:
        """The only way grading refers to a mirrored image: by digest."""
        return f"{self.repository}@{self.digest}"


_V_COLS = "image, digest, instance_id, backend, valid, reason, details, validated_at"
_M_COLS = "image, registry, repository, digest, image_id, mirrored_at"


def record_validation(conn: psycopg.Connection, rec: ValidationRecord) -> None:
    conn.execute(
        f"INSERT INTO image_validations ({_V_COLS}) VALUES (%s, %s, %s, %s, %s, %s, %s, %s) "
        "ON CONFLICT (instance_id, digest) DO UPDATE SET image = EXCLUDED.image, backend = EXCLUDED.backend, "
        "valid = EXCLUDED.valid, reason = EXCLUDED.reason, details = EXCLUDED.details, "
        "validated_at = EXCLUDED.validated_at",
        (rec.image, rec.digest, rec.instance_id, rec.backend, rec.valid, rec.reason, Jsonb(rec.details),
         rec.validated_at),
    )
    conn.commit()


def validated(
    conn: psycopg.Connection, instance_rows: Iterable[dict], backend: str | Grader | None = "docker"
) -> dict[str, ValidationRecord | None]:
    """For the dispatcher: each row's latest validation of its own `image` (None: never validated).

    A record with valid=False says why in `reason`. backend: the grader (or its name in
    eval_worker.graders.GRADERS) whose records count; None accepts records of any grader.
    """
    if backend is not None:
        backend = grader_name(backend)
    rows = list(instance_rows)
    out: dict[str, ValidationRecord | None] = {r["instance_id"]: None for r in rows}
    if not rows:
        return out
    wanted = {(r["instance_id"], r["image"]) for r in rows}
    cur = conn.execute(
        f"SELECT DISTINCT ON (instance_id, image) {_V_COLS} FROM image_validations "
        "WHERE instance_id = ANY(%s) AND (%s::text IS NULL OR backend = %s) "
        "ORDER BY instance_id, image, validated_at DESC",
        ([r["instance_id"] for r in rows], backend, backend),
    )
    for row in cur.fetchall():
        rec = ValidationRecord(**dict(zip(_V_COLS.split(", "), row)))
        if (rec.instance_id, rec.image) in wanted:
            out[rec.instance_id] = rec
    conn.commit()
    return out


def record_mirror(conn: psycopg.Connection, rec: MirrorRecord) -> None:
    conn.execute(
        f"INSERT INTO image_mirrors ({_M_COLS}) VALUES (%s, %s, %s, %s, %s, %s) "
        "ON CONFLICT (image, registry) DO UPDATE SET repository = EXCLUDED.repository, "
        "digest = EXCLUDED.digest, image_id = EXCLUDED.image_id, mirrored_at = EXCLUDED.mirrored_at",
        (rec.image, rec.registry, rec.repository, rec.digest, rec.image_id, rec.mirrored_at),
    )
    conn.commit()


def mirror_record(conn: psycopg.Connection, image: str, registry: str) -> MirrorRecord | None:
    row = conn.execute(
        f"SELECT {_M_COLS} FROM image_mirrors WHERE image = %s AND registry = %s", (image, registry)
    ).fetchone()
    conn.commit()
    return MirrorRecord(**dict(zip(_M_COLS.split(", "), row))) if row else None
