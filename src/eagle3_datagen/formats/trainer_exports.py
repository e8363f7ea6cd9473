"""The trainer exports as the workflow sees them: one registered entry per export (`export.formats`).

An entry says what the disk model, the job sizes, the config checks and the layer check need to know of
an export without importing its stage: the exporter (`module:class` in `stages/export/`, imported only by
the export job), its files' byte model and its CPU rate, the `hidden_states.final` its trainer can take,
whether its own section gzips its samples, and how to read one sample's stored slots back. Nothing else
compares an export's name: a new export is its exporter's module, its entry here and `export.formats`'
enum in the config schema (which a test holds equal to this registry).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from eagle3_datagen.formats import storage
from eagle3_datagen.registry import Registry, import_implementation


def _never(section: dict) -> bool:
    return False


def _specforge_slots(export: Path, index: int):
    """Sample `index`'s (auxiliary states [L, A*H], final state [L, H]) in a SpecForge export: one row file
    a sample, in sorted order (`.ckpt`, or `.ckpt.gz` under `export.specforge.compress: gzip`)."""
    import gzip
    import io

    import torch

    path = sorted(p for p in export.glob("rows_*/*") if p.name.endswith((".ckpt", ".ckpt.gz")))[index]
    data = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    row = torch.load(io.BytesIO(data), weights_only=True)
    return row["aux_hidden_state"][0], row["hidden_state"][0]


def _speculators_slots(export: Path, index: int):
    """Sample `index`'s (auxiliary states [L, A*H], final state [L, H]) in a speculators export: its
    `hs_{index}.safetensors`, auxiliary slots first, the final layer last."""
    from safetensors.torch import load_file

    from eagle3_datagen.formats.hidden_shard import split_stacked

    return split_stacked(load_file(export / "hidden_states" / f"hs_{index}.safetensors")["hidden_states"])


@dataclass(frozen=True)
class TrainerExport:
    """A trainer export (`results/{partition}/export/{name}`).

    `implementation`: the exporter class (`module:class`), built from the shards, the target model's
    directory, the draft vocabulary and its own `export.<name>` section ({} where it has none); `files`:
    its byte model beside the states (`storage.ExportBytes`); `bytes_per_core_s`: bf16 bytes of states a
    core exports a second, the shard's parts read back included (bench/states_cpu.py), and
    `gzip_bytes_per_core_s` where `gzip(section)` compresses its samples; `finals`: the
    `hidden_states.final` settings its trainer can take, `final_reason` why not the others;
    `read_slots(export_dir, index)`: one sample's auxiliary and final states as stored, whose final layer is
    `final_slot` (`normed`: after the final norm, `raw`: before)."""

    name: str
    implementation: str
    files: storage.ExportBytes
    bytes_per_core_s: float
    read_slots: Callable
    final_slot: str
    gzip: Callable[[dict], bool] = _never
    gzip_bytes_per_core_s: float | None = None
    finals: tuple[str, ...] = ("raw", "normed")
    final_reason: str = ""

    def settings(self, config: dict) -> dict:
        """Its section of the `export` settings ({} where it has none)."""
        return config["export"].get(self.name) or {}

    def gzipped(self, config: dict) -> bool:
        return self.gzip(self.settings(config))

    def rate(self, config: dict) -> float:
        """bf16 bytes of states a core exports a second under the config's settings."""
        return self.gzip_bytes_per_core_s if self.gzipped(config) else self.bytes_per_core_s

    def exporter(self):
        """The exporter class, imported when the export job first uses it."""
        return import_implementation(self.implementation)


EXPORTS: Registry[TrainerExport] = Registry("trainer export")

for entry in (
    TrainerExport(
        name="specforge",
        implementation="eagle3_datagen.stages.export.specforge:SpecForgeExport",
        # a sample's torch.save zip of four tensors (framing measured on real files), int64 input_ids and loss_mask
        files=storage.ExportBytes(per_token=16, per_sample=2_300),
        bytes_per_core_s=180e6,
        gzip=lambda section: section["compress"] == "gzip",
        gzip_bytes_per_core_s=39e6,
        read_slots=_specforge_slots,
        final_slot="normed",
    ),
    TrainerExport(
        name="speculators",
        implementation="eagle3_datagen.stages.export.speculators:SpeculatorsExport",
        # int64 token_ids in the states file, input_ids and loss_mask in the Arrow rows; per sample the Arrow
        # rows' two list offsets and seq_len and a safetensors header (framing measured on real files). fp8
        # with scales that broadcast over a row stays fp8 (speculators 0.9.0's fp8 hidden-states backend).
        files=storage.ExportBytes(
            per_token=8 + 16, per_sample=24 + 160, fp8_scales=("token", "channel"), fp8_per_sample=24 + 250
        ),
        bytes_per_core_s=220e6,
        read_slots=_speculators_slots,
        final_slot="raw",
        finals=("raw",),
        final_reason="speculators 0.9.0 applies the verifier's final norm to the last slot itself and would "
        "norm it twice",
    ),
):
    EXPORTS.register(entry.name)(entry)
