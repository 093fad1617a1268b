-- The forecast a run was started with (`run` makes it before building or launching anything), so that `report`
-- can set it against what the run took. A resumed run keeps its first.
CREATE TABLE run_forecasts (
    run       text PRIMARY KEY,
    made_at   timestamptz NOT NULL,
    forecast  jsonb NOT NULL
);
