"""A hidden-state shard: its layout (layers, final state, storage), its packed parts, and its reader.

Layer numbering follows transformers' `hidden_states`: index 0 is the embedding output and
index i the output of decoder layer i (1-based). `final: normed` is the final norm's
output (what the LM head sees), `raw` the output of layer N. Samples are packed with no
padding into parts of at most `shard_bytes`; `index.json` lists the parts, their samples and
each part's xxh3-64 checksum (`formats.checksums`), which `HiddenShard` checks before reading a part.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import shutil
import time
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import zstandard

from eagle3_datagen.formats.checksums import ALGORITHM, check, digest, file_digest
from eagle3_datagen.formats.files import atomic_path, read_json, write_json
from eagle3_datagen.formats.hidden_codec import (
    REFERENCE_DTYPE,
    STATE_COLUMNS,
    Codec,
    PartReader,
    frame_header_json,
    reference_rows,
)
from eagle3_datagen.formats.released import RELEASED, finished_copy

FORMAT = "eagle3-datagen/hidden-v1"


COLUMNS = ("input_ids", "loss_mask", "aux_hidden_states", "hidden_states")


def resolve_aux_layers(num_layers: int, spec: str | Sequence[int]) -> list[int]:
    """`auto` is EAGLE-3's choice, hidden_states indices [2, N//2, N-3]; lists are checked.

    Index N (the last layer's output) is refused: SGLang captures layer inputs, so it can never
    hand it over as an auxiliary state (`final: raw` stores it)."""
    layers = [2, num_layers // 2, num_layers - 3] if spec == "auto" else [int(i) for i in spec]
    if len(set(layers)) != len(layers) or any(not 1 <= i < num_layers for i in layers):
        raise ValueError(
            f"aux_layers {layers} must be distinct hidden_states indices in 1..{num_layers - 1} "
            f"for a {num_layers}-layer model"
        )
    return layers


def split_stacked(states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """States stacked by slot, [T, A + 1, H] (the auxiliary layers, then the final one: vLLM's connector files
    and speculators' export hold them so), as a capture hands them on: (auxiliary [T, A*H], final [T, H])."""
    return states[:, :-1].flatten(1), states[:, -1]


@dataclass(frozen=True)
class Layout:
    """What a shard stores; checked against the config when a shard is read."""

    model: str
    num_layers: int
    hidden_size: int
    aux_layers: tuple[int, ...]
    final: str
    dtype: str

    def fingerprint(self) -> str:
        return hashlib.sha256(json.dumps(self.__dict__, sort_keys=True, default=list).encode()).hexdigest()[:16]


def plan_parts(lengths: Sequence[int], bytes_per_token: int, shard_bytes: int) -> list[range]:
    """Consecutive sample ranges whose packed size stays within `shard_bytes` (one sample may exceed it)."""
    parts, start, size = [], 0, 0
    for index, length in enumerate(lengths):
        sample_bytes = length * bytes_per_token
        if index > start and size + sample_bytes > shard_bytes:
            parts.append(range(start, index))
            start, size = index, 0
        size += sample_bytes
    if start < len(lengths):
        parts.append(range(start, len(lengths)))
    return parts


def part_key(layout: Layout, codec: Codec, ids: Sequence[str], lengths: Sequence[int]) -> str:
    """Identifies a part's content plan: resuming keeps a part only if this matches."""
    digest = hashlib.sha256(layout.fingerprint().encode())
    digest.update(codec.describe().encode())
    for sample_id, length in zip(ids, lengths, strict=True):
        digest.update(f"{sample_id}:{length};".encode())
    return digest.hexdigest()


def part_metadata(path: Path) -> dict | None:
    """The metadata a complete part carries; None for a missing, torn or foreign file."""
    if not path.exists():
        return None
    try:
        return json.loads(frame_header_json(path)["__metadata__"][FORMAT])
    except Exception:  # anything unreadable is recomputed
        return None


def raw_size(path: Path) -> int:
    """A part's size before compression (zstd frames record it in their header)."""
    if path.suffix != ".zst":
        return path.stat().st_size
    with path.open("rb") as f:
        return zstandard.frame_content_size(f.read(18))


def checksum_path(path: Path) -> Path:
    """Where an unfinished shard keeps a part's checksum until index.json records it."""
    return path.with_name(path.name + "." + ALGORITHM)


def kept_part_checksum(path: Path) -> str | None:
    """The checksum of a part complete from an earlier run, if its bytes still match it (None: recompute)."""
    recorded = checksum_path(path)
    if not recorded.exists():
        return None
    expected = recorded.read_text().strip()
    return expected if file_digest(path) == expected else None


def recapture_fix(shard_dir: Path) -> str:
    return f"recapture that shard: `snakemake --forcerun {shard_dir}` (or delete {shard_dir} and rerun snakemake)"


class ShardReleased(FileNotFoundError):
    """A shard whose parts were removed once every reader had read them; the message says what to do."""


def released_message(shard_dir: Path, record: dict) -> str:
    return (
        f"{shard_dir}: its parts were removed at {record['released_at']} once {', '.join(record['after'])} had "
        "read them (hidden_states.keep_shards: false: the exports are the run's one copy of the states). Reading "
        f"it again means capturing it again on the GPU node ({record['tokens']:,} tokens; `python scripts/plan.py` "
        f"counts the hours): delete {shard_dir} and rerun snakemake, which captures it and reruns what reads it. "
        "Set hidden_states.keep_shards: true to keep the shards of later runs"
    )


def release_parts(shard_dir: str | Path, after: Sequence[str], probe: dict | None = None) -> int:
    """Remove a finished shard's parts once `after` (the outputs made from them) are done, keeping
    index.json (counts, sizes, checksums: what the report and the plan read) and `released.json`, which
    says when and after what, and keeps what its probe measured (`probe`, its result: a probe with other
    thresholds is judged again from it). Returns the bytes freed. Snakemake dates a directory output by its
    `.snakemake_timestamp`, which stays, so the shard and what was made from it remain up to date."""
    shard_dir = Path(shard_dir)
    index = read_json(shard_dir / "index.json")
    if not (shard_dir / RELEASED).exists():
        record = {
            "released_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "after": list(after),
            "tokens": index["tokens"],
            "bytes": index["bytes"],
            "probe": probe,
        }
        write_json(shard_dir / RELEASED, record)  # first: a reader never sees a shard with parts missing
    shutil.rmtree(finished_copy(shard_dir), ignore_errors=True)  # its parts' second names
    freed = 0
    for part in index["parts"]:
        path = shard_dir / part["file"]
        if path.exists():
            freed += path.stat().st_size
            path.unlink()
    return freed


def write_part(
    path: Path,
    samples: Sequence[dict],
    states: Sequence[tuple[torch.Tensor, torch.Tensor]],
    codec: Codec,
    metadata: dict,
    reference_count: int = 0,
    seed: int = 0,
) -> tuple[int, str]:
    """Write one packed part and its checksum file; returns its size before compression and its checksum.

    With a lossy `codec`, `reference_count` rows are also kept in bf16 (`reference_rows`,
    `reference_<column>`) for the probe to compare against."""
    lengths = [len(s["input_ids"]) for s in samples]
    offsets = torch.zeros(len(samples) + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int64), 0)
    loss_mask = torch.tensor([t for s in samples for t in s["loss_mask"]], dtype=torch.uint8)
    aux = torch.cat([aux for aux, _ in states])
    final = torch.cat([final for _, final in states])
    tensors = {
        "input_ids": torch.tensor([t for s in samples for t in s["input_ids"]], dtype=torch.int32),
        "loss_mask": loss_mask,
        **codec.encode_states("aux_hidden_states", aux, aux.shape[1] // final.shape[1]),
        **codec.encode_states("hidden_states", final, 1),
        "offsets": offsets,
    }
    if codec.fp8 and reference_count:
        rows = reference_rows(loss_mask, offsets, reference_count, seed)
        tensors["reference_rows"] = rows
        tensors["reference_aux_hidden_states"] = aux[rows].to(REFERENCE_DTYPE).contiguous()
        tensors["reference_hidden_states"] = final[rows].to(REFERENCE_DTYPE).contiguous()
    # One metadata key: safetensors orders several keys differently from run to run, and
    # a resumed part must be byte-identical to an uninterrupted one.
    raw_bytes, checksum = codec.write_part(path, tensors, {FORMAT: json.dumps(metadata, sort_keys=True)})
    with atomic_path(checksum_path(path)) as tmp:
        tmp.write_text(checksum)
    return raw_bytes, checksum


class ShardIndex:
    """What a shard's index.json says (layout, samples, storage), whether its parts are there or released: what
    an export rebuilt from its kept copy reads of the shard (`stages/export/kept.py`)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.index = read_json(self.path / "index.json")
        self.codec = Codec.from_index(self.index)

    @property
    def ids(self) -> list[str]:
        return [sid for part in self.index["parts"] for sid in part["ids"]]

    def __len__(self) -> int:
        return self.index["samples"]


class HiddenShard:
    """Read a hidden-state shard: iterate samples in order or fetch one by id.

    Each part's bytes are checked against the checksum in index.json the first time it is opened
    (`formats.checksums.ChecksumError` on a mismatch, naming the part, the shard and the fix). A shard
    whose parts were released (`release_parts`) raises `ShardReleased`, naming what to do."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if (self.path / RELEASED).exists():
            raise ShardReleased(released_message(self.path, read_json(self.path / RELEASED)))
        self.index = json.loads((self.path / "index.json").read_text())
        if self.index.get("format") != FORMAT:
            raise ValueError(f"{self.path}: not an {FORMAT} shard")
        self._where = {sid: (n, k) for n, part in enumerate(self.index["parts"]) for k, sid in enumerate(part["ids"])}
        self.codec = Codec.from_index(self.index)
        self._cached_name: str | None = None
        self._cached: PartReader | None = None
        self._verified: set[str] = set()

    @property
    def ids(self) -> list[str]:
        return [sid for part in self.index["parts"] for sid in part["ids"]]

    def __len__(self) -> int:
        return self.index["samples"]

    def check_layout(self, aux_layers: Sequence[int], final: str) -> None:
        if list(aux_layers) != self.index["aux_layers"] or final != self.index["final"]:
            raise ValueError(
                f"{self.path}: stored layers aux={self.index['aux_layers']} final={self.index['final']} "
                f"do not match the configured aux={list(aux_layers)} final={final}; rerun the hidden stage"
            )

    def _sample(self, f: PartReader, offsets: torch.Tensor, sid: str, k: int, columns: Sequence[str] = COLUMNS) -> dict:
        a, b = int(offsets[k]), int(offsets[k + 1])
        return {"id": sid, **{name: f.rows(name, a, b) for name in columns}}

    def _check(self, part: dict, actual: str) -> None:
        check(self.path / part["file"], part.get(ALGORITHM), actual, self.path / "index.json", recapture_fix(self.path))
        self._verified.add(part["file"])

    def _open(self, part: dict):
        """A part's decoded rows, its checksum checked: memory-mapped when plain, decompressed whole
        (and kept) when not."""
        path = self.path / part["file"]
        if not self.codec.compressed:
            if part["file"] not in self._verified:
                self._check(part, file_digest(path))
            return self.codec.open_part(path)
        if self._cached_name != part["file"]:
            data = path.read_bytes()
            self._check(part, digest(data))
            self._cached = self.codec.decode_part(data)
            self._cached_name = part["file"]
        return contextlib.nullcontext(self._cached)

    def iter_samples(self, columns: Sequence[str] = COLUMNS) -> Iterator[dict]:
        """Samples in order, with only `columns` read (e.g. no auxiliary states); fp8 states
        come back dequantized to bf16."""
        for part in self.index["parts"]:
            with self._open(part) as f:
                offsets = f.tensor("offsets")
                for k, sid in enumerate(part["ids"]):
                    yield self._sample(f, offsets, sid, k, columns)

    def __iter__(self) -> Iterator[dict]:
        return self.iter_samples()

    def sample(self, sample_id: str, columns: Sequence[str] = COLUMNS) -> dict:
        """One sample by id, with only `columns` read."""
        number, k = self._where[sample_id]
        with self._open(self.index["parts"][number]) as f:
            return self._sample(f, f.tensor("offsets"), sample_id, k, columns)

    def __getitem__(self, sample_id: str) -> dict:
        return self.sample(sample_id)

    def part_samples(
        self, number: int, held_out: Collection[str] = (), raw: bool = False, columns: Sequence[str] = COLUMNS
    ) -> list[dict]:
        """The samples of part `number` whose id is not in `held_out`, read on the caller's thread with no
        cache shared (so several threads read parts side by side), the part's checksum checked first.
        fp8 states come dequantized to bf16, or with `raw` as stored with their scales (`{column}_scale`)."""
        part = self.index["parts"][number]
        path = self.path / part["file"]
        if self.codec.compressed:
            data = path.read_bytes()
            self._check(part, digest(data))
            return self._part_rows(self.codec.decode_part(data), part, held_out, raw, columns)
        self._check(part, file_digest(path))
        with self.codec.open_part(path) as reader:
            return self._part_rows(reader, part, held_out, raw, columns)

    @staticmethod
    def _part_rows(reader: PartReader, part: dict, held_out, raw: bool, columns: Sequence[str]) -> list[dict]:
        offsets = reader.tensor("offsets")
        samples = []
        for k, sid in enumerate(part["ids"]):
            if sid in held_out:
                continue
            a, b = int(offsets[k]), int(offsets[k + 1])
            sample = {"id": sid}
            for name in columns:
                sample.update(reader.stored_rows(name, a, b) if raw else {name: reader.rows(name, a, b)})
            samples.append(sample)
        return samples

    def references(self) -> Iterator[dict]:
        """Per part of a lossy shard, its bf16 reference rows (none for lossless shards): the
        token each row's state predicts (`targets`), and `reference` and `stored` (decoded) states."""
        for part in self.index["parts"]:
            with self._open(part) as f:
                if not f.has("reference_rows"):
                    continue
                rows = f.tensor("reference_rows")
                yield {
                    "targets": f.rows_at("input_ids", rows + 1).long(),
                    "reference": {name: f.tensor(f"reference_{name}") for name in STATE_COLUMNS},
                    "stored": {name: f.rows_at(name, rows) for name in STATE_COLUMNS},
                }


# The layers the capture runner records for the layer check (stages/hidden/layer_tap.py), beside the shard.
LAYER_TAP_SUFFIX = ".layers.safetensors"


def layer_tap_path(out_dir: str | Path) -> Path:
    """Where the layers recorded for a shard's directory (results/{p}/hidden/{shard}) go: beside it."""
    out_dir = Path(out_dir)
    return out_dir.with_name(out_dir.name + LAYER_TAP_SUFFIX)
