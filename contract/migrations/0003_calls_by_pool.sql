-- The planner reads a pool's most recent calls every few seconds (dispatcher.planner.observe): without this
-- index that is a sort of the whole ledger, which grows by ten rows per attempt.
CREATE INDEX calls_pool_recent ON calls (pool, started_at DESC);
