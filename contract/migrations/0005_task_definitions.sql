-- ECS task-definition revisions per task image (dispatcher.launchers.task_definitions).
-- RunTask cannot override a container's image, so each task image gets its own revision, derived from the
-- estate's template task definition. One row per (template, image): every dispatcher reuses it, so a
-- revision is registered once, however many runs and dispatcher restarts use the image.
CREATE TABLE task_definitions (
    template       text NOT NULL,              -- the template's task-definition ARN (family:revision)
    image          text NOT NULL,              -- the task image by digest: <registry>/<repository>@sha256:...
    arn            text NOT NULL UNIQUE,       -- the revision registered for it
    registered_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (template, image)
);
