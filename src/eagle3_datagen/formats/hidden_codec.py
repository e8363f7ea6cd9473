"""How a part stores its hidden states: element type, fp8 scales, byte planes and compression.

- `dtype` bfloat16, float16 or float32 stores the states as they are (cast); `float8_e4m3` or
  `float8_e5m2` stores them as fp8 values with power-of-two scales beside them, one per token
  and layer (`token`), per channel over the part (`channel`), or per token and block of
  `scale_block` channels (`block`). Scales are powers of two, so value x scale is exact in bf16:
  readers dequantize to bf16 without a second rounding.
- `compress`: `none`; `zstd` (the part's safetensors bytes, one zstd frame); `zstd_planes`
  (each multi-byte state tensor stored as its byte planes, then zstd): the high byte of a bf16
  value (sign, exponent, one mantissa bit) is predictable and compresses well, the low byte is
  nearly random; kept apart, zstd models each on its own. Decoding restores identical bits.
  fp8 values are single bytes, so for fp8 `zstd_planes` stores the same bytes as `zstd`.
- Lossy dtypes keep a bf16 reference of a few rows of each part (`reference_positions` per
  shard, rows whose next token is loss-masked), so the probe can measure on the same positions
  what the storage costs the draft model's inputs.
"""

from __future__ import annotations

import contextlib
import json
import math
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import zstandard
from safetensors import safe_open
from safetensors.torch import load as safetensors_load
from safetensors.torch import save as safetensors_bytes

from eagle3_datagen.formats.checksums import digest
from eagle3_datagen.formats.files import atomic_path
from eagle3_datagen.formats.storage import shard_bytes_per_token

PLAIN_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
FP8_DTYPES = {"float8_e4m3": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}
STATE_COLUMNS = ("aux_hidden_states", "hidden_states")
COMPRESS = ("none", "zstd", "zstd_planes")
GRANULARITIES = ("token", "channel", "block")
SCALE_DTYPE = torch.bfloat16  # holds any power of two a float32 does, in 2 bytes
REFERENCE_DTYPE = torch.bfloat16


@dataclass(frozen=True)
class Codec:
    """A shard's storage settings (`hidden_states.dtype`, `scales`, `scale_block`, `compress`)."""

    dtype: str
    scales: str  # fp8 only
    scale_block: int  # fp8 `block` only
    compress: str
    level: int
    reference_positions: int  # fp8 only: bf16 rows kept per shard for the probe

    @classmethod
    def from_settings(cls, settings: dict) -> Codec:
        """From the validated `hidden_states` settings, where validation filled every default."""
        codec = cls(
            dtype=settings["dtype"],
            scales=settings["scales"],
            scale_block=settings["scale_block"],
            compress=settings["compress"],
            level=settings["compress_level"],
            reference_positions=settings["reference_positions"],
        )
        if codec.dtype not in PLAIN_DTYPES and codec.dtype not in FP8_DTYPES:
            raise ValueError(f"hidden_states.dtype {codec.dtype!r}: use one of {[*PLAIN_DTYPES, *FP8_DTYPES]}")
        if codec.compress not in COMPRESS or codec.scales not in GRANULARITIES:
            raise ValueError(f"hidden_states.compress must be one of {COMPRESS}, scales one of {GRANULARITIES}")
        return codec

    @classmethod
    def from_index(cls, index: dict) -> Codec:
        """The codec a finished shard's index.json records (shards from before fp8 included). An index
        records scales only for fp8 and compression only when compressed: absent, they do not apply, and
        the values here only fill the fields. A reader keeps no reference rows."""
        scales = index.get("scales") or {}
        compress = index.get("compress") or {}
        return cls(
            dtype=index["dtype"],
            scales=scales.get("granularity", "token"),
            scale_block=scales.get("block", 0),
            compress=compress.get("codec", "none"),
            level=compress.get("level", 0),
            reference_positions=0,
        )

    @property
    def fp8(self) -> bool:
        return self.dtype in FP8_DTYPES

    @property
    def compressed(self) -> bool:
        return self.compress != "none"

    def block(self, hidden_size: int) -> int:
        block = min(self.scale_block, hidden_size)
        if hidden_size % block:
            raise ValueError(f"hidden_states.scale_block {self.scale_block} must divide the hidden size {hidden_size}")
        return block

    def bytes_per_token(self, aux_layers: int, hidden_size: int) -> int:
        """Bytes one packed token takes before compression: states, their per-token scales, ID and mask."""
        if self.fp8 and self.scales == "block":
            self.block(hidden_size)  # refuses a block that does not divide the hidden size
        return shard_bytes_per_token(self.dtype, self.scales, self.scale_block, aux_layers, hidden_size)

    def index_fields(self) -> dict:
        """What index.json records about the storage."""
        scales = None
        if self.fp8:
            scales = {"granularity": self.scales, "dtype": "bfloat16"}
            if self.scales == "block":
                scales["block"] = self.scale_block
        return {
            "scales": scales,
            "compress": {"codec": self.compress, "level": self.level} if self.compressed else None,
        }

    def describe(self) -> str:
        """Everything that changes a part's bytes: resuming keeps a part only under the same codec."""
        return json.dumps({**self.__dict__, "reference_positions": self.reference_positions if self.fp8 else 0})

    # Writing

    def encode_states(self, name: str, states: torch.Tensor, layers: int) -> dict[str, torch.Tensor]:
        """The tensors stored for one state column [T, layers * H]."""
        if self.fp8:
            values, scales = quantize(states, layers, FP8_DTYPES[self.dtype], self.scales, self.scale_block)
            return {name: values, f"{name}_scale": scales}
        values = states.to(PLAIN_DTYPES[self.dtype]).contiguous()
        return {name: byte_planes(values) if self.compress == "zstd_planes" else values}

    def part_bytes(self, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> tuple[bytes, int]:
        """The file's bytes and their size before compression. One zstd frame, compressed on one thread:
        zstd's multithreaded mode costs a sixth to a quarter more CPU a byte (BENCHMARKS.md), so a capture
        compresses several parts side by side instead (`stages/hidden/shard.PartWriter`)."""
        data = safetensors_bytes(tensors, metadata=metadata)
        if not self.compressed:
            return data, len(data)
        return zstandard.ZstdCompressor(level=self.level).compress(data), len(data)

    def write_part(self, path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> tuple[int, str]:
        """Write a part; returns its size before compression and the checksum of the bytes written."""
        data, raw_size = self.part_bytes(tensors, metadata)
        with atomic_path(path) as tmp:
            tmp.write_bytes(data)
        return raw_size, digest(data)

    def part_name(self, number: int) -> str:
        return f"part-{number:05d}.safetensors" + (".zst" if self.compressed else "")

    # Reading

    @contextlib.contextmanager
    def open_part(self, path: Path) -> Iterator[PartReader]:
        """A plain part's rows as memory-mapped slices."""
        with safe_open(str(path), "pt") as f:
            yield PartReader(self, f)

    def decode_part(self, data: bytes) -> PartReader:
        """A compressed part's bytes, decompressed whole (byte planes joined back)."""
        tensors = safetensors_load(zstandard.ZstdDecompressor().decompress(data))
        if self.compress == "zstd_planes" and not self.fp8:  # fp8 values are one byte: no planes
            for name in STATE_COLUMNS:
                tensors[name] = from_byte_planes(tensors[name], PLAIN_DTYPES[self.dtype])
        return PartReader(self, tensors)


def quantize(
    states: torch.Tensor, layers: int, dtype: torch.dtype, granularity: str, scale_block: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8 values of `states` [T, layers * H] and their power-of-two scales (bf16).

    Scale shapes: `token` [T, layers], `channel` [layers * H], `block` [T, layers * H / block].
    Non-finite values do not set a scale (they are flagged by the caller and stay non-finite).
    """
    x = states.float()
    tokens, columns = x.shape
    group = {"token": columns // layers, "channel": columns, "block": min(scale_block, columns // layers)}[granularity]
    magnitude = torch.where(torch.isfinite(x), x.abs(), 0.0)
    if granularity == "channel":
        amax = magnitude.amax(0) if tokens else torch.zeros(columns)
    else:
        amax = magnitude.reshape(tokens, columns // group, group).amax(-1)
    fp8_max = torch.finfo(dtype).max
    # The smallest power of two that brings the largest magnitude within fp8's range.
    scales = torch.exp2(torch.ceil(torch.log2(amax.clamp_min(torch.finfo(torch.float32).tiny) / fp8_max)))
    spread = scales if granularity == "channel" else scales.repeat_interleave(group, dim=-1)
    values = (x / spread).clamp(-fp8_max, fp8_max).to(dtype)  # NaN stays NaN; +-inf saturates
    return values, scales.to(SCALE_DTYPE)


def dequantize(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """bf16 states from fp8 values [T, C] and scales of any layout `quantize` writes (exact)."""
    if scales.dim() == 1:
        return values.to(torch.bfloat16) * scales
    return values.to(torch.bfloat16) * scales.repeat_interleave(values.shape[-1] // scales.shape[-1], dim=-1)


def byte_planes(values: torch.Tensor) -> torch.Tensor:
    """uint8 [k, T, C] for a k-byte tensor [T, C]: plane i holds byte i of every element
    (little-endian: the last plane is the high byte)."""
    tokens, columns = values.shape
    k = values.element_size()
    return values.contiguous().view(torch.uint8).reshape(tokens, columns, k).permute(2, 0, 1).contiguous()


def from_byte_planes(planes: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The inverse of `byte_planes`: identical bits."""
    k, tokens, columns = planes.shape
    return planes.permute(1, 2, 0).contiguous().reshape(tokens, columns * k).view(dtype)


class PartReader:
    """Rows of one part, dequantized to bf16 when stored as fp8."""

    def __init__(self, codec: Codec, source):
        self.codec = codec
        self.source = source  # a safe_open handle or a dict of decoded tensors
        self._whole = isinstance(source, dict)

    def tensor(self, name: str) -> torch.Tensor:
        return self.source[name] if self._whole else self.source.get_tensor(name)

    def has(self, name: str) -> bool:
        return name in (self.source if self._whole else self.source.keys())

    def _slice(self, name: str, start: int, stop: int) -> torch.Tensor:
        return self.source[name][start:stop] if self._whole else self.source.get_slice(name)[start:stop]

    def rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        values = self._slice(name, start, stop)
        if not (self.codec.fp8 and name in STATE_COLUMNS):
            return values
        scale = f"{name}_scale"
        return dequantize(
            values, self.tensor(scale) if self.codec.scales == "channel" else self._slice(scale, start, stop)
        )

    def stored_rows(self, name: str, start: int, stop: int) -> dict[str, torch.Tensor]:
        """`name`'s rows as stored: fp8 values with their scales under `{name}_scale` (the rows' own, or the
        part's per channel), any other dtype as it is."""
        stored = {name: self._slice(name, start, stop)}
        if self.codec.fp8 and name in STATE_COLUMNS:
            scale = f"{name}_scale"
            stored[scale] = self.tensor(scale) if self.codec.scales == "channel" else self._slice(scale, start, stop)
        return stored

    def rows_at(self, name: str, rows: torch.Tensor) -> torch.Tensor:
        """Scattered rows, reading only those."""
        if not len(rows):
            return self.rows(name, 0, 0)
        return torch.cat([self.rows(name, int(r), int(r) + 1) for r in rows])


def reference_rows(loss_mask: torch.Tensor, offsets: torch.Tensor, count: int, seed: int) -> torch.Tensor:
    """Up to `count` rows of a part, sorted, drawn uniformly (seeded) from the rows whose next row
    is a loss-masked token of the same sample: the states the probe reads."""
    mask = loss_mask.numpy().astype(bool)
    candidate = np.zeros(len(mask), dtype=bool)
    candidate[:-1] = mask[1:]
    candidate[offsets[1:].numpy() - 1] = False  # a sample's last row predicts the next sample's first
    rows = np.flatnonzero(candidate)
    if len(rows) > count:
        rows = np.sort(np.random.default_rng(seed).choice(rows, count, replace=False))
    return torch.from_numpy(rows.astype(np.int64))


def reference_share(positions: int, part_tokens: int, shard_tokens: int) -> int:
    """A part's share of the shard's reference rows, by tokens."""
    return math.ceil(positions * part_tokens / shard_tokens) if shard_tokens else 0


def frame_header_json(path: Path) -> dict:
    """The safetensors header of a part, reading (and decompressing) only that far."""
    with path.open("rb") as raw:
        if path.suffix != ".zst":
            size = struct.unpack("<Q", raw.read(8))[0]
            return json.loads(raw.read(size))
        with zstandard.ZstdDecompressor().stream_reader(raw) as reader:
            size = struct.unpack("<Q", reader.read(8))[0]
            return json.loads(reader.read(size))
