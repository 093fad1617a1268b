-- The judge's verdicts: one row per (attempt, rubric), written by `python -m dispatcher judge` (dispatcher/judge/).
-- A rubric is identified by a hash of its questions, so an edited rubric judges again instead of reusing answers
-- to other questions. The judge's calls are in the ledger (calls) under its own run name, <run>.judge.
CREATE TABLE judge_verdicts (
    run          text NOT NULL,
    instance_id  text NOT NULL,
    attempt      integer NOT NULL,
    rubric_sha   text NOT NULL,                 -- sha256 of the rubric's questions (first 16 hex digits)
    rubric       text NOT NULL,                 -- its name, for people
    status       text NOT NULL CHECK (status IN ('judged', 'parse_failure', 'no_trajectory', 'over_attempt_cap')),
    answers      jsonb,                         -- question id -> {"answer": true|false, "reason": text} (judged)
    problem      text,                          -- why not judged (parse_failure, no_trajectory, over_attempt_cap)
    raw_answer   text,                          -- the model's answer as it came
    judge_run    text NOT NULL,                 -- the ledger's run name for the judge's calls
    model        text NOT NULL,
    calls        integer NOT NULL DEFAULT 0,
    cost_usd     numeric(18, 9) NOT NULL DEFAULT 0,
    judged_at    timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (run, instance_id, attempt, rubric_sha),
    FOREIGN KEY (run, instance_id, attempt) REFERENCES attempts (run, instance_id, attempt)
);
