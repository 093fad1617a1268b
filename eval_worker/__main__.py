"""The eval worker CLI.

  python -m eval_worker --queue URL [--backend process|docker|package.module:Class] [--logs-root DIR] [--once]
         [--idle-exit S] [--visibility-timeout S] [--database-url URL] [--registry HOST:PORT] [--require-pinned]
         [--environments FILE ...]
  python -m eval_worker validate --dataset PATH [--instances ID ...] [--backend docker|process|package.module:Class]
         [--repos DIR] [--logs-root DIR] [--timeout S] [--registry HOST:PORT] [--environments FILE ...]
  python -m eval_worker mirror --dataset PATH --registry HOST:PORT [--instances ID ...] [--no-pull]

--backend names a grader (eval_worker.graders.GRADERS) or a dotted path to a Grader subclass.
validate and mirror record into PostgreSQL ($DATABASE_URL, default postgresql://postgres@127.0.0.1:5432/test)
and print one JSON line per instance/image; exit 1 if anything is invalid or failed.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
from pathlib import Path

from eval_worker.graders import GRADERS, GraderOptions, UnknownName
from eval_worker.package_index import PACKAGE_INDEX_ENV


def _logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    logging.getLogger("botocore").setLevel(logging.WARNING)


def _grader_name(value: str) -> str:
    """--backend: a registered grader, or a dotted path to a Grader subclass."""
    try:
        GRADERS.get(value)
    except UnknownName as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return value


def _grader(name: str, options: GraderOptions):
    """The grader `name` built from the command line's options; exits 2 naming a bad recipe file."""
    from eval_worker.environments import GradingEnvironmentError

    try:
        return GRADERS.get(name).from_options(options)
    except GradingEnvironmentError as e:
        print(f"--environments: {e}", file=sys.stderr)
        raise SystemExit(2) from None


BACKEND_METAVAR = "{" + ",".join(GRADERS.names()) + "}|package.module:Class"
PACKAGE_INDEX_HELP = ("docker backend: the simple-API URL of the package index gradings may reach, and nothing else "
                      f"(default ${PACKAGE_INDEX_ENV}; none: they reach no network)")
ENVIRONMENTS_HELP = ("process backend: a TOML file of environment recipes ([[environment]] tables), in addition "
                     "to the environments.toml beside each repository bundle; repeatable")


def worker_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m eval_worker", description="Grade EvalJob messages from SQS.")
    ap.add_argument("--queue", required=True, help="eval queue URL (SQS)")
    ap.add_argument("--backend", type=_grader_name, default="process", metavar=BACKEND_METAVAR,
                    help="the grader (eval_worker.graders): docker: the official run_instance in the instance image "
                         "(official results); process: a local sandbox (approximation, no Docker); or a dotted path "
                         "to a Grader subclass")
    ap.add_argument("--logs-root", type=Path, default=Path("."),
                    help="root of the official layout logs/run_evaluation/... (default: current directory)")
    ap.add_argument("--once", action="store_true", help="handle at most one message (one long poll), then exit")
    ap.add_argument("--idle-exit", type=float, default=None, metavar="SECONDS",
                    help="exit after this many seconds without a message")
    ap.add_argument("--visibility-timeout", type=int, default=120, metavar="S",
                    help="visibility timeout per message; extended every S/3 while grading (default 120)")
    ap.add_argument("--wait-time", type=int, default=20, help="long-polling wait per receive (max 20)")
    ap.add_argument("--sandbox-root", type=Path, default=None, help="process backend: where sandboxes go")
    ap.add_argument("--keep-sandboxes", action="store_true", help="process backend: keep sandboxes (debugging)")
    ap.add_argument("--environments", type=Path, action="append", default=[], metavar="FILE", help=ENVIRONMENTS_HELP)
    ap.add_argument("--database-url", default=os.environ.get("DATABASE_URL"),
                    help="docker backend: image validation/mirror records (default $DATABASE_URL; none: "
                         "grade on the local tag's image id)")
    ap.add_argument("--registry", default=None, help="docker backend: pull mirrored images by digest from here")
    ap.add_argument("--require-pinned", action="store_true",
                    help="docker backend: infra_error unless the image has a valid validation or mirror record")
    ap.add_argument("--package-index", default=os.environ.get(PACKAGE_INDEX_ENV), help=PACKAGE_INDEX_HELP)
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args(argv)
    _logging(args.verbose)

    from eval_worker.worker import EvalWorker

    if problem := GRADERS.get(args.backend).unavailable():
        print(f"--backend {args.backend}: {problem}", file=sys.stderr)
        return 2
    grader = _grader(args.backend, GraderOptions(
        database_url=args.database_url, registry=args.registry, require_pinned=args.require_pinned,
        package_index=args.package_index, sandbox_root=args.sandbox_root, keep_sandboxes=args.keep_sandboxes,
        environments=tuple(args.environments)))
    from contract import signing

    try:
        verdict_key = signing.key_from_env(signing.VERDICT_KEY_ENV)
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    if not verdict_key:
        print(f"{signing.VERDICT_KEY_ENV} is not set: verdicts must be signed with the verdict key", file=sys.stderr)
        return 2
    worker = EvalWorker(
        args.queue,
        verdict_key=verdict_key,
        logs_root=args.logs_root,
        grader=grader,
        visibility_timeout=args.visibility_timeout,
        wait_time_s=min(max(args.wait_time, 0), 20),
    )
    try:
        n = worker.run(once=args.once, idle_exit=args.idle_exit)
    except KeyboardInterrupt:
        return 130
    logging.getLogger("eval_worker").info("handled %d message(s)", n)
    return 0


def validate_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m eval_worker validate",
                                 description="Gold-validate instance images and record the result per digest.")
    ap.add_argument("--dataset", required=True, help=".json/.jsonl/.parquet instance rows")
    ap.add_argument("--instances", nargs="*", default=None)
    ap.add_argument("--backend", type=_grader_name, default="docker", metavar=BACKEND_METAVAR,
                    help="the grader validating: docker (the official image, by digest) or process")
    ap.add_argument("--repos", default=None, help="process backend: <owner>__<name>.bundle folder "
                                                  "(default: <dataset dir>/repos)")
    ap.add_argument("--logs-root", type=Path, default=None, help="official layout root (default: a temp dir)")
    ap.add_argument("--timeout", type=float, default=1800.0, help="eval script timeout per run (s)")
    ap.add_argument("--registry", default=None, help="docker: validate the mirrored image (by digest)")
    ap.add_argument("--database-url", default=None)
    ap.add_argument("--environments", type=Path, action="append", default=[], metavar="FILE", help=ENVIRONMENTS_HELP)
    ap.add_argument("--package-index", default=os.environ.get(PACKAGE_INDEX_ENV), help=PACKAGE_INDEX_HELP)
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args(argv)
    _logging(args.verbose)

    import json

    from contract import db
    from eval_worker.images import load_rows
    from eval_worker.validation import validate

    url = args.database_url or db.database_url()
    rows = load_rows(args.dataset, args.instances)
    repos = args.repos or str(Path(args.dataset).resolve().parent / "repos")
    logs_root = args.logs_root or Path(tempfile.mkdtemp(prefix="ep-validate-"))
    # validation reads the image's own records only to pull a mirrored image by digest
    grader = _grader(args.backend, GraderOptions(
        database_url=url if args.registry else None, registry=args.registry, package_index=args.package_index,
        environments=tuple(args.environments)))
    with db.connect(url) as conn:
        db.migrate(conn)
        records, errors = validate(rows, conn, grader=grader, repos_dir=repos, logs_root=logs_root,
                                   timeout_s=args.timeout)
    for r in records:
        print(r.model_dump_json(include={"instance_id", "image", "digest", "backend", "valid", "reason"}))
    for e in errors:
        print(json.dumps({"error": e}))
    logging.getLogger("eval_worker").info("logs: %s", logs_root)
    return 0 if not errors and all(r.valid for r in records) else 1


def mirror_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m eval_worker mirror",
                                 description="Copy instance images into a private registry; record digests.")
    ap.add_argument("--dataset", required=True)
    ap.add_argument("--registry", required=True, help="HOST:PORT (or an ECR registry host)")
    ap.add_argument("--instances", nargs="*", default=None)
    ap.add_argument("--no-pull", action="store_true", help="only mirror images present locally")
    ap.add_argument("--database-url", default=None)
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args(argv)
    _logging(args.verbose)

    import json

    from contract import db
    from eval_worker.images import load_rows
    from eval_worker.mirror import mirror

    rows = load_rows(args.dataset, args.instances)
    with db.connect(args.database_url or db.database_url()) as conn:
        db.migrate(conn)
        records, errors = mirror(rows, args.registry, conn, pull=not args.no_pull)
    for r in records:
        print(json.dumps({"image": r.image, "ref": r.ref, "image_id": r.image_id}))
    for e in errors:
        print(json.dumps({"error": e}))
    return 0 if not errors else 1


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "validate":
        return validate_main(argv[1:])
    if argv and argv[0] == "mirror":
        return mirror_main(argv[1:])
    return worker_main(argv)


if __name__ == "__main__":
    sys.exit(main())
