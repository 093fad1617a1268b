"""One ECS task-definition revision per task image.

RunTask can override a container's command but not its image, and every attempt runs its own task image (its
instance's image plus the runtime layer). So each task image, by digest, gets a revision derived from the estate's
template task definition (the HarnessFleet's) with only the container's image replaced. A revision is registered
once: an in-process map first, then the `task_definitions` table shared by every dispatcher (a PostgreSQL advisory
lock makes concurrent dispatchers register a given image once), and only then RegisterTaskDefinition, paced by its
own token bucket (ECS throttles it far below RunTask).
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
import threading
from collections.abc import Callable
from typing import Any, Protocol

import botocore.session
import psycopg

from contract import db
from plumbing.token_bucket import TokenBucket

DIGEST_REF = re.compile(r"^[^\s@]+@sha256:[0-9a-f]{64}$")
T_TEMPLATE, T_IMAGE_DIGEST = "evalplane:template", "evalplane:image-digest"


class TaskImageError(ValueError):
    """An attempt's task image cannot be run on ECS (missing, or not a reference by digest)."""


def check_image(image: str | None) -> str:
    if not image:
        raise TaskImageError(
            "no task image: on ECS every attempt runs its instance's task image, by digest "
            "(build them with `python -m dispatcher images <spec.toml>`)")
    if not DIGEST_REF.match(image):
        raise TaskImageError(
            f"task image {image!r} is not a reference by digest (<registry>/<repository>@sha256:<64 hex>): "
            "a tag can move, and a revision is registered once per image")
    return image


@functools.cache
def register_fields() -> frozenset[str]:
    """What RegisterTaskDefinition accepts, from botocore's own service model (so new fields carry over)."""
    model = botocore.session.get_session().get_service_model("ecs")
    return frozenset(model.operation_model("RegisterTaskDefinition").input_shape.members)


def derive_revision(template: dict[str, Any], tags: list[dict[str, str]], container: str, image: str,
                    template_arn: str, secrets: dict[str, str] | None = None) -> dict[str, Any]:
    """RegisterTaskDefinition's arguments for `image`: the template (as DescribeTaskDefinition returns it) with only
    `container`'s image replaced (and `secrets`, env name -> secret ARN, added to its secrets), and the template's
    tags plus which template and image it came from."""
    args = {k: v for k, v in template.items() if k in register_fields() and k != "tags" and v is not None}
    containers = [dict(c) for c in args.get("containerDefinitions", [])]
    named = [c for c in containers if c.get("name") == container]
    if len(named) != 1:
        raise ValueError(f"template {template_arn} has no single container named {container!r} "
                         f"(has {[c.get('name') for c in containers]})")
    named[0]["image"] = image
    if secrets:
        kept = [x for x in named[0].get("secrets", []) if x["name"] not in secrets]
        named[0]["secrets"] = kept + [{"name": k, "valueFrom": v} for k, v in secrets.items()]
    args["containerDefinitions"] = containers
    extra = {T_TEMPLATE: template_arn, T_IMAGE_DIGEST: image.rpartition("@")[2]}
    args["tags"] = [t for t in tags if t["key"] not in extra] + [{"key": k, "value": v} for k, v in extra.items()]
    return args


class RevisionCache(Protocol):
    def get_or_register(self, template: str, image: str, register: Callable[[], str]) -> str:
        """The revision recorded for (template, image); else register() it, once across dispatchers, and record it."""


class PgRevisionCache:
    """The `task_definitions` table (contract/migrations/0005). One connection, used under a lock."""

    def __init__(self, url: str | None = None):
        self.url = url
        self._conn: psycopg.Connection | None = None
        self._lock = threading.Lock()

    def _connection(self) -> psycopg.Connection:
        if self._conn is None or self._conn.closed or self._conn.broken:
            self._conn = db.connect(self.url, autocommit=True)
            db.migrate(self._conn)
        return self._conn

    def get_or_register(self, template: str, image: str, register: Callable[[], str]) -> str:
        with self._lock:
            conn = self._connection()
            with conn.transaction():
                # held until commit: a second dispatcher asking for the same image waits here, then finds the row
                conn.execute("SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))", (f"{template}\n{image}",))
                row = conn.execute("SELECT arn FROM task_definitions WHERE template = %s AND image = %s",
                                   (template, image)).fetchone()
                if row:
                    return row[0]
                arn = register()
                conn.execute("INSERT INTO task_definitions (template, image, arn) VALUES (%s, %s, %s)",
                             (template, image, arn))
                return arn

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()


class TaskImageRevisions:
    """The template's revision for each task image: remembered in process, else the shared cache, else registered.

    call: the launcher's ECS call (it backs off and retries on throttling); pace: the registration token bucket."""

    def __init__(self, template: str, container: str, cache: RevisionCache, call: Callable[..., dict],
                 pace: TokenBucket, secrets: dict[str, str] | None = None):
        """secrets: what the revisions add to the container's secrets (a run's own: its revisions are then the
        run's, cached under the template and a digest of them)."""
        self.template, self.container = template, container
        self.secrets = dict(secrets or {})
        self.cache_key = template if not self.secrets else \
            f"{template}#secrets-{hashlib.sha256(json.dumps(self.secrets, sort_keys=True).encode()).hexdigest()[:16]}"
        self.cache, self._call, self.pace = cache, call, pace
        self._known: dict[str, str] = {}
        self._described: tuple[dict, list] | None = None
        self._lock = threading.Lock()
        self.registered = 0  # revisions this process registered (the rest came from the cache)

    def arn(self, image: str | None) -> str:
        image = check_image(image)
        found = self._known.get(image)
        if found is None:
            found = self._known[image] = self.cache.get_or_register(self.cache_key, image, lambda: self._register(image))
        return found

    def _describe(self) -> tuple[dict, list]:
        with self._lock:
            if self._described is None:
                resp = self._call("describe_task_definition", taskDefinition=self.template, include=["TAGS"])
                self._described = resp["taskDefinition"], resp.get("tags", [])
            return self._described

    def _register(self, image: str) -> str:
        template, tags = self._describe()
        args = derive_revision(template, tags, self.container, image, self.template, self.secrets)
        self.pace.acquire()
        arn = self._call("register_task_definition", **args)["taskDefinition"]["taskDefinitionArn"]
        self.registered += 1
        return arn
