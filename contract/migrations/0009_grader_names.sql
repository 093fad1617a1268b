-- A validation is recorded under its grader's name, which may be any registered grader or a dotted path to one
-- kept outside the project (eval_worker.graders), not only the two the project ships.
ALTER TABLE image_validations DROP CONSTRAINT IF EXISTS image_validations_backend_check;
