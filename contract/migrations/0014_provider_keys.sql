-- The run's provider key (dispatcher/provider_keys): which provider and key id hold the run's cap, the name of the
-- key in the gateway's key file (a resumed run finds it again), and the key's usage as the provider reported it
-- when the run ended (the third meter; the provider may be gone by the time the run is reported).
CREATE TABLE provider_keys (
    owner       text PRIMARY KEY,
    provider    text NOT NULL,
    key_id      text NOT NULL,
    key_name    text NOT NULL,
    limit_usd   numeric(18, 9),
    usage       jsonb,
    created_at  timestamptz NOT NULL DEFAULT now(),
    revoked_at  timestamptz
);
