import psycopg

from contract import db


def test_migrations_apply_once_and_are_idempotent(database_url):
    with psycopg.connect(database_url) as conn:
        assert db.migrate(conn) == []  # the session fixture already applied them
        tables = {r[0] for r in conn.execute("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")}
        assert {"runs", "attempts", "phases", "calls", "schema_migrations"} <= tables
        versions = [r[0] for r in conn.execute("SELECT version FROM schema_migrations ORDER BY version")]
        assert versions == [v for v, _, _ in db.migrations()]


def test_attempt_unique_on_run_instance_attempt(pg):
    pg.execute(
        "INSERT INTO runs (run, spec, spec_hash, backend, attempts) VALUES ('u1', '{}', 'h', 'local', 1)"
    )
    row = ("u1", "i1", 1, "mini-swe-agent", "pool", "m", "submitted", "EMPTY_PATCH")
    sql = "INSERT INTO attempts (run, instance_id, attempt, harness, pool, model, outcome, status) VALUES (%s,%s,%s,%s,%s,%s,%s,%s)"
    pg.execute(sql, row)
    try:
        pg.execute(sql, row)
    except psycopg.errors.UniqueViolation:
        pg.rollback()
    else:
        raise AssertionError("duplicate attempt row was accepted")
