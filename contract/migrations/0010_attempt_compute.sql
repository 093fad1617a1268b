-- What an attempt's compute was and used, beside its tokens (contract.models TaskResources, ComputeUsage):
-- the task's resources as the spec set them ([backend] task_cpu, task_memory, task_memory_limit), what its container
-- counted (CPU-seconds, memory peak, its life), and its grading's wall and CPU time. Priced by
-- contract/compute_prices.py against contract/prices/compute.toml. NULL where not recorded (rows landed before).
ALTER TABLE attempts
    ADD COLUMN IF NOT EXISTS task_cpu                double precision,  -- vCPUs
    ADD COLUMN IF NOT EXISTS task_memory_mib         integer,           -- guaranteed
    ADD COLUMN IF NOT EXISTS task_memory_limit_mib   integer,           -- the kill threshold
    ADD COLUMN IF NOT EXISTS task_cpu_s              double precision,
    ADD COLUMN IF NOT EXISTS task_memory_peak_bytes  bigint,
    ADD COLUMN IF NOT EXISTS task_wall_s             double precision,
    ADD COLUMN IF NOT EXISTS usage_source            text,              -- cgroup | ecs | rusage
    ADD COLUMN IF NOT EXISTS grading_wall_s          double precision,
    ADD COLUMN IF NOT EXISTS grading_cpu_s           double precision;
