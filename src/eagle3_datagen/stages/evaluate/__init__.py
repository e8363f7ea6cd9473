"""The evaluate stage: a draft trained on the data by a trainer's release, its acceptance length measured
by speculative decoding of the target (runs in the trainer's own venv: `make specforge-env`)."""
