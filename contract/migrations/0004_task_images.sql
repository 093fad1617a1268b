-- Task images: an instance's own image plus the task runtime layer, one per (instance, harness, inputs).
-- `inputs` hashes everything the image is made of (the instance image's digest, the runtime's sources and
-- requirements, the layer's recipe), so an image whose inputs did not change is reused, never rebuilt.
CREATE TABLE task_images (
    instance_id     text NOT NULL,
    harness         text NOT NULL,
    inputs          text NOT NULL,
    registry        text NOT NULL DEFAULT '',   -- '' = the local engine only (no push)
    ref             text NOT NULL,              -- what launchers run: <registry>/<repository>@sha256:... or sha256:<image id>
    image_id        text NOT NULL,              -- config digest
    instance_image  text NOT NULL,              -- the base, by digest (or local image id)
    runtime_image   text NOT NULL,              -- the runtime image id the layer came from
    size_bytes      bigint NOT NULL,            -- the whole image
    layer_bytes     bigint NOT NULL,            -- what the task layers add to the instance image
    build_s         double precision NOT NULL,
    built_at        timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (instance_id, harness, inputs, registry)
);
