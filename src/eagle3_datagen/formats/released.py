"""What a released shard keeps (hidden_states.keep_shards: false): the names the capture, probe, export and the
preflight share. Torch-free: the preflight reads them before any job."""

from __future__ import annotations

from pathlib import Path

# Beside a shard's index.json once its parts are removed (`hidden_shard.release_parts`); it keeps what the
# shard's probe measured.
RELEASED = "released.json"
# The probe settings that choose the positions measured and how they are reported: a released shard's probe
# is judged again from its recorded measurements only while these (and the model) are unchanged.
PROBE_MEASURING = ("max_positions", "first_positions", "report_positions", "seed")


def probe_measured_with(probe: dict, model_path: str) -> dict:
    """What a probe's measurements depend on: the `probe` section's measuring settings and the model."""
    return {**{name: probe[name] for name in PROBE_MEASURING}, "model": str(model_path)}


def kept_export(results: str | Path, partition: str, fmt: str) -> Path:
    """A released partition's kept copy of its export of `fmt` (hard links to its files: stages/export/kept.py)."""
    return Path(results) / partition / "hidden" / "kept" / fmt


def finished_copy(shard_dir: str | Path) -> Path:
    """The sibling `.<shard>.finished/` that links a finished shard's files (stages/hidden/finished.py)."""
    shard_dir = Path(shard_dir)
    return shard_dir.with_name(f".{shard_dir.name}.finished")
