-- `pause --hold-calls` (issue 35): besides launching nothing, the run's shims hold each new model call until
-- `resume`. The run's own state, as `paused` is; it reaches the shims through Valkey (contract.keys.run_hold).
ALTER TABLE runs
    ADD COLUMN hold_calls boolean NOT NULL DEFAULT false,
    ADD CONSTRAINT runs_hold_calls_paused CHECK (paused OR NOT hold_calls);
