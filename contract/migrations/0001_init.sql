-- Durable record: one row per run, attempt, phase and call.

CREATE TABLE runs (
    run          text PRIMARY KEY,
    spec         jsonb NOT NULL,
    spec_hash    text NOT NULL,
    backend      text NOT NULL,
    status       text NOT NULL DEFAULT 'running' CHECK (status IN ('running', 'finished', 'cancelled')),
    attempts     integer NOT NULL,            -- planned attempts (instances x attempts per instance)
    created_at   timestamptz NOT NULL DEFAULT now(),
    finished_at  timestamptz
);

CREATE TABLE attempts (
    run                 text NOT NULL REFERENCES runs (run),
    instance_id         text NOT NULL,
    attempt             integer NOT NULL CHECK (attempt >= 1),
    harness             text NOT NULL,
    pool                text NOT NULL,
    model               text NOT NULL,
    outcome             text NOT NULL,        -- how the harness phase ended (HarnessOutcome)
    status              text NOT NULL,        -- PATCH_READY | EMPTY_PATCH | RESOLVED | UNRESOLVED | EVAL_ERROR
    patch_uri           text,
    patch_bytes         integer NOT NULL DEFAULT 0,
    trajectory_uri      text,
    calls               integer NOT NULL DEFAULT 0,
    input_tokens        bigint NOT NULL DEFAULT 0,
    cached_tokens       bigint NOT NULL DEFAULT 0,
    cache_write_tokens  bigint NOT NULL DEFAULT 0,
    output_tokens       bigint NOT NULL DEFAULT 0,
    cost_usd            numeric(18, 9) NOT NULL DEFAULT 0,
    wall_time_s         double precision,
    started_at          timestamptz,
    ended_at            timestamptz,
    eval_enqueued_at    timestamptz,
    eval_outcome        text,
    resolved            boolean,
    report              jsonb,
    error               text,
    landed_at           timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (run, instance_id, attempt)
);
CREATE INDEX attempts_status ON attempts (run, status);

CREATE TABLE phases (
    run          text NOT NULL,
    instance_id  text NOT NULL,
    attempt      integer NOT NULL,
    phase        text NOT NULL CHECK (phase IN ('harness', 'eval', 'judge')),
    started_at   timestamptz,
    ended_at     timestamptz,
    outcome      text NOT NULL,
    detail       jsonb,
    PRIMARY KEY (run, instance_id, attempt, phase),
    FOREIGN KEY (run, instance_id, attempt) REFERENCES attempts (run, instance_id, attempt)
);

-- The ledger: one row per inference call, written by the shim, landed by the results writer.
-- No foreign key to attempts: ledger rows may land before their attempt's row.
CREATE TABLE calls (
    call_id             uuid PRIMARY KEY,
    run                 text NOT NULL,
    instance_id         text NOT NULL,
    attempt             integer NOT NULL,
    seq                 integer NOT NULL,
    pool                text NOT NULL,
    provider            text NOT NULL,
    model               text NOT NULL,
    route               text NOT NULL,
    stream              boolean NOT NULL,
    started_at          timestamptz NOT NULL,
    input_tokens        integer NOT NULL,
    cached_tokens       integer NOT NULL,
    cache_write_tokens  integer NOT NULL,
    output_tokens       integer NOT NULL,
    cost_usd            numeric(18, 9) NOT NULL,
    latency_ms          double precision NOT NULL,
    pacer_wait_ms       double precision NOT NULL,
    retries             integer NOT NULL,
    http_status         integer NOT NULL,
    outcome             text NOT NULL,
    usage_estimated     boolean NOT NULL,
    raw_usage           jsonb
);
CREATE INDEX calls_attempt ON calls (run, instance_id, attempt, seq);
