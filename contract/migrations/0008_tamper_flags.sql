-- Tamper flags (eval_worker.tamper): what the graded patch touched that grading reads (test files, conftest.py,
-- pytest configuration, the eval script's inputs), as [{"rule": ..., "files": [...]}]; [] when nothing was flagged,
-- NULL while not graded. The official verdict (status, resolved, report) is never changed by a flag.
ALTER TABLE attempts ADD COLUMN IF NOT EXISTS tamper_flags jsonb;
