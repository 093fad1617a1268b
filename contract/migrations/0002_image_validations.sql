-- Eval images: gold validation per image digest, and private-registry mirrors (eval_worker.records).

-- One row per (instance, image digest): did the gold patch resolve and the untouched base fail the
-- FAIL_TO_PASS tests on exactly this image? Re-validating the same digest replaces the row.
CREATE TABLE image_validations (
    image         text NOT NULL,                 -- the dataset row's `image` (name:tag)
    digest        text NOT NULL,                 -- docker image id (config digest, sha256:...) it ran on
    instance_id   text NOT NULL,
    backend       text NOT NULL DEFAULT 'docker' CHECK (backend IN ('docker', 'process')),
    valid         boolean NOT NULL,
    reason        text,                          -- why invalid (NULL when valid)
    details       jsonb NOT NULL DEFAULT '{}',   -- gold / empty outcomes and F2P results
    validated_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (instance_id, digest)
);
CREATE INDEX image_validations_latest ON image_validations (instance_id, image, validated_at DESC);

-- Where an image was copied to: grading pulls <repository>@<digest> only.
CREATE TABLE image_mirrors (
    image        text NOT NULL,                  -- source name (swebench/sweb.eval.x86_64.*:latest)
    registry     text NOT NULL,                  -- HOST:PORT (or the ECR registry host)
    repository   text NOT NULL,                  -- <registry>/<path>, without tag
    digest       text NOT NULL,                  -- manifest digest in that registry (sha256:...)
    image_id     text NOT NULL,                  -- config digest: the id image_validations.digest uses
    mirrored_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (image, registry)
);
