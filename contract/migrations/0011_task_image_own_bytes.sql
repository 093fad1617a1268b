-- What a task image adds of its own: the bytes no other task image of its harness shares (its pruned /testbed), as
-- opposed to layer_bytes, which also counts the runtime and harness layers every task image shares. `forecast`
-- predicts a spec's registry bytes from it. NULL on images recorded before it was kept.
ALTER TABLE task_images ADD COLUMN own_bytes bigint;
