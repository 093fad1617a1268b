-- The capacity an attempt's task ran on (issue 36 with issue 35's Spot): Fargate Spot is priced at its own rates.
-- The launcher knows it once the task is placed (ECS RunTask's capacityProviderName); NULL where none applies
-- (local tasks) or it was not seen (the price table's default capacity then prices the task).
ALTER TABLE attempts
    ADD COLUMN task_capacity text CHECK (task_capacity IN ('on_demand', 'spot'));
