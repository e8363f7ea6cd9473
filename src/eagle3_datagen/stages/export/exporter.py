"""What every trainer export's class is (`formats.trainer_exports.TrainerExport.implementation`): the shape
`export.export` drives, one sample at a time from any thread, then once to finish."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from eagle3_datagen.formats.hidden_shard import HiddenShard
from eagle3_datagen.stages.export.files import ExportFiles


class Exporter(Protocol):
    """One export being written. Built as `Exporter(shards, model_path, vocab_dir, draft_vocab_size, settings)`
    (`settings`: its own `export.<name>` section, {} where it has none); it refuses shards its trainer cannot
    read (a layout, a final slot) when built, before any file is written."""

    # Whether `add` gets the states as stored (fp8 with its scales) instead of dequantized.
    stored_states: bool

    def __init__(
        self,
        shards: list[HiddenShard],
        model_path: str | Path | None,
        vocab_dir: str | Path | None,
        draft_vocab_size: int | None,
        settings: dict,
    ) -> None: ...

    def add(self, files: ExportFiles, number: int, sample: dict) -> None:
        """Write sample `number` (from any thread)."""

    def finish(self, files: ExportFiles, out_dir: Path, summary: dict) -> dict:
        """Write what the trainer needs beside the samples (its config, command, README) once every sample is
        added; returns what `export.json` records of it beyond `summary`."""
