-- Live control of a run (issue 35): `pause` (its driver launches nothing new until `resume`) and `resize N` (the
-- concurrency ceiling its planner works under; NULL: the spec's backend.concurrency). The run's own state, read by
-- its driver every pass, so a driver started again on a paused run stays paused.
ALTER TABLE runs
    ADD COLUMN IF NOT EXISTS paused       boolean NOT NULL DEFAULT false,
    ADD COLUMN IF NOT EXISTS concurrency  integer CHECK (concurrency >= 1);

-- `retry`: an attempt relaunched as a new attempt number in the slot of the one infrastructure broke. The slot is
-- the attempt number (1..run.attempts) the official outputs and pass@k count it under; the superseded attempt's
-- row stays as it landed.
CREATE TABLE IF NOT EXISTS retries (
    run           text NOT NULL REFERENCES runs (run),
    instance_id   text NOT NULL,
    attempt       integer NOT NULL,   -- the new attempt number
    slot          integer NOT NULL CHECK (slot >= 1),
    replaces      integer NOT NULL,   -- the attempt it relaunches
    reason        text NOT NULL,      -- the class that attempt ended in (status or infra class)
    requested_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (run, instance_id, attempt),
    UNIQUE (run, instance_id, replaces)
);

-- `regrade`: every grading after an attempt's first (its first is the attempts row, never overwritten). The report
-- and the official outputs use an attempt's latest; how, the grader's version and the image digest say what it was.
CREATE TABLE IF NOT EXISTS gradings (
    id              bigserial PRIMARY KEY,
    run             text NOT NULL,
    instance_id     text NOT NULL,
    attempt         integer NOT NULL,
    how             text NOT NULL CHECK (how IN ('logs', 'images')),
    grader_version  text NOT NULL,
    image_digest    text,            -- the image graded on (images); NULL: the recorded logs' own grading
    status          text NOT NULL,
    eval_outcome    text,
    resolved        boolean,
    report          jsonb,
    graded_at       timestamptz NOT NULL DEFAULT now(),
    FOREIGN KEY (run, instance_id, attempt) REFERENCES attempts (run, instance_id, attempt)
);
CREATE INDEX IF NOT EXISTS gradings_attempt ON gradings (run, instance_id, attempt, id);

-- Each attempt as the results and the report count it: its slot, whether a later attempt of its slot has landed
-- with a final status (then it is superseded: kept, shown, not counted), and its latest verdict.
CREATE OR REPLACE VIEW attempt_verdicts AS
SELECT a.run, a.instance_id, a.attempt,
       coalesce(r.slot, a.attempt) AS slot,
       EXISTS (SELECT 1 FROM retries n JOIN attempts b USING (run, instance_id, attempt)
               WHERE n.run = a.run AND n.instance_id = a.instance_id AND n.slot = coalesce(r.slot, a.attempt)
                 AND n.attempt > a.attempt AND b.status <> 'PATCH_READY') AS superseded,
       CASE WHEN g.id IS NULL THEN a.status ELSE g.status END AS status,
       CASE WHEN g.id IS NULL THEN a.eval_outcome ELSE g.eval_outcome END AS eval_outcome,
       CASE WHEN g.id IS NULL THEN a.resolved ELSE g.resolved END AS resolved,
       CASE WHEN g.id IS NULL THEN a.report ELSE g.report END AS report,
       g.id AS grading_id
FROM attempts a
LEFT JOIN retries r USING (run, instance_id, attempt)
LEFT JOIN LATERAL (SELECT * FROM gradings x WHERE x.run = a.run AND x.instance_id = a.instance_id
                   AND x.attempt = a.attempt ORDER BY x.id DESC LIMIT 1) g ON true;
