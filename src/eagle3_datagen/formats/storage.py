"""Bytes on disk of what the hidden-state stage and the exports write, counted without torch.

Per token and per sample, by element type, layout and compression: `Codec` sizes a shard's parts with
`shard_bytes_per_token`, and the plan, the preflight's disk check and the export jobs' resources
(`reporting/plan.py`, `workflow/disk.py`, `workflow/job_resources.py`) count a run's bytes with the rest.
Overheads are the files' own framing, measured on real files (an export's own in its entry,
`formats/trainer_exports.py`; tests/unit/test_storage.py checks the model against exports of every format);
compressed sizes use a finished output's observed ratio where one
exists, else the ratios below, measured on synthetic 7168-wide states (BENCHMARKS.md, `bench/states_cpu.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

ELEMENT_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3": 1, "float8_e5m2": 1}
FP8 = ("float8_e4m3", "float8_e5m2")
# Per token besides the hidden states: int32 input_ids + uint8 loss_mask.
ID_AND_MASK_BYTES = 5
SCALE_BYTES = 2  # bf16 scales: they hold any power of two a float32 does
EXPORT_SCALE_BYTES = 4  # the speculators export's fp8 scales: float32, as speculators' own connector writes them

# Assumed on-disk over raw bytes, until a finished output shows its own: zstd of bf16 states by level
# (synthetic 7168-wide states, BENCHMARKS.md; real 7168-wide states measure 0.70-0.80 with planes; other
# levels count as the nearer measured one), of fp8 values, and gzip level 1 of a SpecForge row (bf16 or
# fp16; float32 states keep more mantissa: not measured, counted at 0.87).
SHARD_RATIOS = {("zstd", 3): 0.79, ("zstd_planes", 3): 0.72, ("zstd_planes", 1): 0.69}
FP8_ZSTD_RATIO = 0.80
GZIP_RATIOS = {2: 0.81, 4: 0.87}

# Framing measured on real files, which every export writes (one `ids.jsonl` line and one export.json
# checksum entry per sample); each export's own is in its entry (formats/trainer_exports.py).
ID_LINE = 45  # a 24-hex-digit id
CHECKSUM_ENTRY = 70
EXPORT_FILES = 4_000  # README, export.json's summary, the draft and train configs, the Arrow dataset's metadata
INDEX_PER_SAMPLE = 30  # index.json's sample ids
INDEX_PER_PART = 250


# The capture's CPU side: bf16 bytes of states a core encodes, compresses, checksums and writes a second
# (bench/states_cpu.py at 7168 wide, one writer thread, CPU time), by storage: what the plan sizes the
# node's CPU side with. zstd was measured at levels 1 and 3; other levels count as the nearer one.
CAPTURE_BYTES_PER_CORE_S = {
    ("plain", "none", 0): 184e6,
    ("plain", "zstd", 3): 159e6,
    ("plain", "zstd_planes", 3): 109e6,
    ("plain", "zstd_planes", 1): 148e6,
    ("fp8", "zstd", 3): 83e6,
}


def capture_bytes_per_core_s(dtype: str, compress: str, level: int) -> float:
    """The capture's CPU side per core for a storage setting (the nearest measured one: fp8 as fp8 with zstd,
    zstd at level 1 or 3)."""
    if dtype in FP8:
        return CAPTURE_BYTES_PER_CORE_S[("fp8", "zstd", 3)]
    if compress == "none":
        return CAPTURE_BYTES_PER_CORE_S[("plain", "none", 0)]
    return CAPTURE_BYTES_PER_CORE_S.get(
        ("plain", compress, 1 if level <= 2 else 3), CAPTURE_BYTES_PER_CORE_S[("plain", compress, 3)]
    )


def export_read_ahead(threads: int) -> int:
    """Parts an export decodes ahead of the samples it writes on `threads` threads: enough to keep them busy,
    few enough to hold in memory (a part is up to hidden_states.shard_bytes before compression)."""
    return max(2, threads // 4)


def shard_bytes_per_token(dtype: str, scales: str, scale_block: int, aux_layers: int, hidden_size: int) -> int:
    """Bytes one packed token takes in a part before compression: states, their per-token scales, ID and
    mask (`channel` scales, one set per part, and fp8's bf16 reference rows are left out: a few per mille)."""
    layers = aux_layers + 1
    if dtype not in FP8:
        return layers * hidden_size * ELEMENT_BYTES[dtype] + ID_AND_MASK_BYTES
    block = min(scale_block, hidden_size)
    per_token_scales = {"token": layers, "channel": 0, "block": layers * hidden_size // block}[scales]
    return layers * hidden_size + per_token_scales * SCALE_BYTES + ID_AND_MASK_BYTES


def assumed_shard_ratio(dtype: str, compress: str, level: int) -> float:
    if compress == "none":
        return 1.0
    if dtype in FP8:
        return FP8_ZSTD_RATIO
    return SHARD_RATIOS.get((compress, 1 if level <= 2 else 3), SHARD_RATIOS[(compress, 3)])


@dataclass(frozen=True)
class ExportBytes:
    """A trainer export's files beside its states, per token and per sample (each export's entry in
    `formats/trainer_exports.py` gives its own): `fp8_scales`, the scale layouts under which it keeps fp8
    states as fp8 (else they are dequantized to bf16), with `fp8_per_sample` framing and the scales'
    float32 bytes."""

    per_token: int
    per_sample: int
    fp8_scales: tuple[str, ...] = ()
    fp8_per_sample: int = 0


@dataclass(frozen=True)
class States:
    """What a partition's shards store: the layout the exports are sized from."""

    aux_layers: int
    hidden_size: int
    dtype: str
    scales: str
    scale_block: int
    compress: str
    reference_positions: int = 0  # fp8: bf16 rows kept per shard for the probe

    @classmethod
    def from_settings(cls, hidden: dict, aux_layers: int, hidden_size: int) -> States:
        """From the validated `hidden_states` settings and the model's shape."""
        fields = (hidden["dtype"], hidden["scales"], hidden["scale_block"], hidden["compress"])
        return cls(aux_layers, hidden_size, *fields, hidden["reference_positions"] if hidden["dtype"] in FP8 else 0)

    @property
    def bf16_bytes_per_token(self) -> int:
        """The states' bytes per token in bf16: what "one copy" is measured against."""
        return (self.aux_layers + 1) * self.hidden_size * 2

    def shard_bytes(self, tokens: int, samples: int, parts: int, ratio: float, shards: int = 1) -> int:
        """`shards` shards' bytes on disk, their parts compressed at `ratio`; fp8's bf16 reference rows (at
        most one per token) and their row numbers included."""
        per_token = shard_bytes_per_token(self.dtype, self.scales, self.scale_block, self.aux_layers, self.hidden_size)
        reference = min(shards * self.reference_positions, tokens) * (self.bf16_bytes_per_token + 8)
        return round((tokens * per_token + reference) * ratio) + samples * INDEX_PER_SAMPLE + parts * INDEX_PER_PART

    def exported_dtype(self, files: ExportBytes) -> str:
        """The element type an export of `files` stores: fp8 stays fp8 only where its trainer's release reads
        the stored scales, else it is dequantized to bf16."""
        if self.dtype in FP8:
            return self.dtype if self.scales in files.fp8_scales else "bfloat16"
        return self.dtype

    def export_raw_bytes(self, files: ExportBytes, tokens: int, samples: int) -> int:
        """An export's bytes before compression: the sample files and everything beside them."""
        dtype = self.exported_dtype(files)
        states = tokens * (self.aux_layers + 1) * self.hidden_size * ELEMENT_BYTES[dtype]
        shared = samples * (ID_LINE + CHECKSUM_ENTRY) + EXPORT_FILES
        per_token, per_sample = files.per_token, files.per_sample
        if dtype in FP8:
            per_sample = files.fp8_per_sample
            if self.scales == "token":
                per_token += (self.aux_layers + 1) * EXPORT_SCALE_BYTES
            else:
                per_sample += (self.aux_layers + 1) * self.hidden_size * EXPORT_SCALE_BYTES
        return states + tokens * per_token + samples * per_sample + shared

    def export_bytes(self, files: ExportBytes, tokens: int, samples: int, gzip_ratio: float | None) -> int:
        """An export's bytes on disk; `gzip_ratio` where its samples are gzipped (None: plain)."""
        raw = self.export_raw_bytes(files, tokens, samples)
        if gzip_ratio is None:
            return raw
        rows = raw - samples * (ID_LINE + CHECKSUM_ENTRY) - EXPORT_FILES
        return round(rows * gzip_ratio) + samples * (ID_LINE + CHECKSUM_ENTRY + 3) + EXPORT_FILES

    def assumed_gzip_ratio(self, files: ExportBytes) -> float:
        return GZIP_RATIOS[4 if self.exported_dtype(files) == "float32" else 2]
