"""`CheckpointManager` and its policies: what to keep (`_retention_policy`), when to save
(`_save_policy`), the fallback past a corrupt checkpoint, preemption. Imports the pipeline and
the layers under it, never the package's public functions."""
