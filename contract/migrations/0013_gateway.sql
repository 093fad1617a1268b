-- The gateway tier (gateway/): its keys (hashed; one per run, scoped to the run's aliases, with an expiry), its
-- aliases (one per (model, harness) pool, each with its deployments), its meter (one row per call it served), and
-- the gateway's call id on the shim's own ledger row, so the two meters can be matched call by call.
CREATE TABLE gateway_keys (
    key_hash    text PRIMARY KEY,
    owner       text NOT NULL UNIQUE,   -- the run (or the judge) the key was minted for
    aliases     text[] NOT NULL,
    budget_usd  numeric(18, 9),         -- refused once the gateway's meter reaches it; NULL: no budget of its own
    expires_at  timestamptz NOT NULL,
    revoked_at  timestamptz,
    created_at  timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE gateway_aliases (
    alias       text PRIMARY KEY,
    deployments jsonb NOT NULL,         -- [{model, api_base, key_name}]: the provider key is named, never stored here
    updated_at  timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE gateway_calls (
    gateway_call_id     text PRIMARY KEY,
    owner               text NOT NULL,
    alias               text NOT NULL,
    deployment          text NOT NULL,
    route               text NOT NULL,
    started_at          timestamptz NOT NULL,
    input_tokens        integer NOT NULL,
    cached_tokens       integer NOT NULL,
    cache_write_tokens  integer NOT NULL,
    output_tokens       integer NOT NULL,
    cost_usd            numeric(18, 9) NOT NULL,
    latency_ms          double precision NOT NULL,
    status              text NOT NULL,
    replica             text NOT NULL
);
CREATE INDEX gateway_calls_owner ON gateway_calls (owner, started_at);

ALTER TABLE calls ADD COLUMN gateway_call_id text;
