-- The time a call was held by its pool's outage breaker (shim/breaker.py): not the model's, and not counted
-- against the attempt's wall time.
ALTER TABLE calls ADD COLUMN held_ms double precision NOT NULL DEFAULT 0;
