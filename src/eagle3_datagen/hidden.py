"""Stage 4: one prefill pass captures EAGLE-3's auxiliary layers and the final layer.

Layer numbering follows transformers' `hidden_states`: index 0 is the embedding output and
index i the output of decoder layer i (1-based). `final: normed` is the final norm's
output (what the LM head sees), `raw` the output of layer N.

Samples are written in input order, packed with no padding, into parts of at most
`shard_bytes`. Parts are planned from the token counts before any forward pass, so a
rerun after a kill keeps every complete part and recomputes only the rest.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import zstandard

from .hidden_codec import (
    REFERENCE_DTYPE,
    STATE_COLUMNS,
    Codec,
    PartReader,
    frame_header_json,
    reference_rows,
    reference_share,
)
from .io import atomic_dir, read_jsonl, write_json
from .models import load_causal_lm
from .progress import Progress

log = logging.getLogger(__name__)

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


def plan_batches(lengths: Sequence[int], max_batch_tokens: int, packed: bool = False) -> list[list[int]]:
    """Length-sorted batches within the token budget: counted as rows x longest for padded
    forward passes, as the sum of lengths for packed ones."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    batches, current, total = [], [], 0
    for index in order:
        longest = lengths[index]  # sorted ascending: the newcomer is the longest
        size = total + longest if packed else (len(current) + 1) * longest
        if current and size > max_batch_tokens:
            batches.append(current)
            current, total = [], 0
        current.append(index)
        total += longest
    if current:
        batches.append(current)
    return batches


class SingleProcess:
    """The lockstep interface of `capture_sglang.TensorParallelRanks` for one process."""

    writer = True

    def agree(self, value):
        return value


class HFCapture:
    """Forward passes with transformers; hooks collect only the layers that are stored."""

    packed = False  # right-padded batches
    ranks = SingleProcess()

    def __init__(self, model_path: str | Path, aux_spec, final: str, settings: dict, trust_remote_code=False):
        self.lm = load_causal_lm(model_path, settings, trust_remote_code)
        config = self.lm.config
        self.num_layers = config.num_hidden_layers
        self.hidden_size = config.hidden_size
        self.aux_layers = resolve_aux_layers(self.num_layers, aux_spec)
        self.final = final
        self.model_name = Path(model_path).name

    def _decoder_layers(self):
        return self.lm.model.layers

    @torch.inference_mode()
    def __call__(self, batch: list[list[int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per sample: (aux [T, A*H], final [T, H]) for a batch of token ID lists."""
        longest = max(len(ids) for ids in batch)
        device = self.lm.device
        input_ids = torch.zeros((len(batch), longest), dtype=torch.long)
        mask = torch.zeros_like(input_ids)
        for row, ids in enumerate(batch):
            input_ids[row, : len(ids)] = torch.tensor(ids)
            mask[row, : len(ids)] = 1
        wanted = list(self.aux_layers) + ([self.num_layers] if self.final == "raw" else [])
        captured: dict[int, torch.Tensor] = {}
        hooks = []
        layers = self._decoder_layers()
        for index in set(wanted):

            def keep(_module, _args, output, index=index):
                captured[index] = output[0] if isinstance(output, tuple) else output

            hooks.append(layers[index - 1].register_forward_hook(keep))
        try:
            # Right padding under a causal mask leaves every real token's states unchanged.
            out = self.lm.model(input_ids=input_ids.to(device), attention_mask=mask.to(device))
        finally:
            for hook in hooks:
                hook.remove()
        final = captured[self.num_layers] if self.final == "raw" else out.last_hidden_state
        aux = torch.cat([captured[i] for i in self.aux_layers], dim=-1)
        return [(aux[row, : len(ids)].cpu(), final[row, : len(ids)].cpu()) for row, ids in enumerate(batch)]


def capture_in_batches(capture, sequences: Sequence[list[int]], max_batch_tokens: int) -> list:
    """`capture`'s states for every token ID list, in order, over budgeted batches; on a
    tensor-parallel rank that does not write, only the forward passes run (and None is returned)."""
    states: list = [None] * len(sequences)
    for batch in plan_batches([len(ids) for ids in sequences], max_batch_tokens, capture.packed):
        batch_states = capture([sequences[i] for i in batch])
        if capture.ranks.writer:
            for i, state in zip(batch, batch_states, strict=True):
                states[i] = state
    return states


def _part_key(layout: Layout, codec: Codec, ids: Sequence[str], lengths: Sequence[int]) -> str:
    """Identifies a part's content plan: resuming keeps a part only if this matches."""
    digest = hashlib.sha256(layout.fingerprint().encode())
    digest.update(codec.describe().encode())
    for sample_id, length in zip(ids, lengths, strict=True):
        digest.update(f"{sample_id}:{length};".encode())
    return digest.hexdigest()


def _part_metadata(path: Path) -> dict | None:
    """The metadata a complete part carries; None for a missing, torn or foreign file."""
    if not path.exists():
        return None
    try:
        return json.loads(frame_header_json(path)["__metadata__"][FORMAT])
    except Exception:  # anything unreadable is recomputed
        return None


def _raw_size(path: Path) -> int:
    """A part's size before compression (zstd frames record it in their header)."""
    if path.suffix != ".zst":
        return path.stat().st_size
    with path.open("rb") as f:
        return zstandard.frame_content_size(f.read(18))


def write_part(
    path: Path,
    samples: Sequence[dict],
    states: Sequence[tuple[torch.Tensor, torch.Tensor]],
    codec: Codec,
    metadata: dict,
    reference_count: int = 0,
    seed: int = 0,
) -> int:
    """Write one packed part; returns its size before compression.

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
    return codec.write_part(path, tensors, {FORMAT: json.dumps(metadata, sort_keys=True)})


def capture_shard(samples: list[dict], out_dir: str | Path, capture, settings: dict) -> dict | None:
    """Write `samples`' hidden states to `out_dir` (parts, then index.json), resuming a partial run.

    `capture` is an `HFCapture` or an `SGLangCapture`; with tensor parallelism every rank calls
    this with the same samples, runs the same forward passes, and only the writer rank writes and
    returns the index (the others return None).
    """
    out_dir = Path(out_dir)
    ranks = capture.ranks
    layout = Layout(
        capture.model_name,
        capture.num_layers,
        capture.hidden_size,
        tuple(capture.aux_layers),
        capture.final,
        settings["dtype"],
    )
    codec = Codec.from_settings(settings)
    per_token = codec.bytes_per_token(len(layout.aux_layers), layout.hidden_size)
    lengths = [len(s["input_ids"]) for s in samples]
    parts = plan_parts(lengths, per_token, settings["shard_bytes"])
    # Work happens in a sibling directory that Snakemake does not own, so complete parts
    # survive a killed job and the output directory appears only when whole.
    work = out_dir.with_name(f".{out_dir.name}.partial")
    ids = [[samples[i]["id"] for i in part] for part in parts]
    keys = [
        _part_key(layout, codec, part_ids, [lengths[i] for i in part])
        for part, part_ids in zip(parts, ids, strict=True)
    ]
    paths = [work / codec.part_name(number) for number in range(len(parts))]
    earlier: list[dict | None] = [None] * len(parts)
    if ranks.writer:
        work.mkdir(parents=True, exist_ok=True)
        earlier = [_part_metadata(path) for path in paths]
    # Only the writer reads the files; every rank must skip the same parts or the collectives hang.
    kept = ranks.agree([done is not None and done["part_key"] == key for done, key in zip(earlier, keys, strict=True)])
    nonfinite: list[str] = []
    index_parts = []
    started, computed_tokens = time.monotonic(), 0
    progress = Progress(len(samples), "samples", log)
    for number, part in enumerate(parts):
        part_samples = [samples[i] for i in part]
        part_tokens = sum(lengths[i] for i in part)
        if kept[number]:
            log.info("part %d: complete from an earlier run, kept", number)
            if ranks.writer:
                nonfinite += earlier[number]["nonfinite"]
        else:
            states = capture_in_batches(capture, [s["input_ids"] for s in part_samples], settings["max_batch_tokens"])
            if ranks.writer:
                bad = [
                    sid
                    for sid, (aux, fin) in zip(ids[number], states, strict=True)
                    if not (torch.isfinite(aux).all() and torch.isfinite(fin).all())
                ]
                nonfinite += bad
                metadata = {"part_key": keys[number], "nonfinite": bad}
                reference = reference_share(codec.reference_positions, part_tokens, sum(lengths))
                write_part(paths[number], part_samples, states, codec, metadata, reference, seed=number)
                computed_tokens += part_tokens
                log.info("part %d: %d samples, %d tokens written", number, len(part), part_tokens)
        progress.advance(len(part), tokens=part_tokens)
        if ranks.writer:
            index_parts.append(
                {
                    "file": paths[number].name,
                    "samples": len(part),
                    "tokens": part_tokens,
                    "bytes": paths[number].stat().st_size,
                    "raw_bytes": _raw_size(paths[number]),
                    "ids": ids[number],
                }
            )
    progress.close()
    if not ranks.writer:
        return None
    # Parts of an earlier plan (another shard_bytes or compression) must not ship with this one.
    for stale in set(work.iterdir()) - set(paths):
        stale.unlink()
    limit = settings.get("max_nonfinite_fraction", 0.0)
    if samples and len(nonfinite) / len(samples) > limit:
        raise FloatingPointError(
            f"{len(nonfinite)} of {len(samples)} samples have NaN/Inf hidden states (first: {nonfinite[:5]}), "
            f"above hidden_states.max_nonfinite_fraction={limit}; check the model's dtype"
        )
    index = {
        "format": FORMAT,
        **{k: (list(v) if isinstance(v, tuple) else v) for k, v in layout.__dict__.items()},
        "bytes_per_token": per_token,
        "samples": len(samples),
        "tokens": sum(lengths),
        "loss_tokens": sum(sum(s["loss_mask"]) for s in samples),
        "bytes": sum(p["bytes"] for p in index_parts),
        "raw_bytes": sum(p["raw_bytes"] for p in index_parts),
        **codec.index_fields(),
        "nonfinite_ids": nonfinite,
        # This job's forward passes and writes (parts kept from an earlier job excluded).
        "throughput": {"seconds": round(time.monotonic() - started, 3), "tokens": computed_tokens},
        "parts": index_parts,
    }
    write_json(work / "index.json", index)
    with atomic_dir(out_dir) as tmp:
        tmp.rmdir()
        os.replace(work, tmp)
    return index


def run_hidden(
    tokens_path: str | Path, out_dir: str | Path, model_path: str | Path, model_settings: dict, settings: dict
) -> dict | None:
    """Capture one token shard with the configured backend (`hf` or `sglang`)."""
    trust_remote_code = model_settings.get("trust_remote_code", False)
    if settings.get("backend", "hf") == "sglang":
        from .capture_sglang import load_sglang_capture

        capture = load_sglang_capture(
            model_path,
            settings["aux_layers"],
            settings["final"],
            settings.get("sglang", {}),
            trust_remote_code,
            settings["max_batch_tokens"],
        )
    else:
        capture = HFCapture(
            model_path, settings["aux_layers"], settings["final"], settings.get("hf", {}), trust_remote_code
        )
    return capture_shard(read_jsonl(tokens_path), out_dir, capture, settings)


class HiddenShard:
    """Read a hidden-state shard: iterate samples in order or fetch one by id."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.index = json.loads((self.path / "index.json").read_text())
        if self.index.get("format") != FORMAT:
            raise ValueError(f"{self.path}: not an {FORMAT} shard")
        self._where = {sid: (n, k) for n, part in enumerate(self.index["parts"]) for k, sid in enumerate(part["ids"])}
        self.codec = Codec.from_index(self.index)
        self._cached_name: str | None = None
        self._cached: PartReader | None = None

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

    def _open(self, part: dict):
        """A part's decoded rows: memory-mapped when plain, decompressed whole (and kept) when not."""
        path = self.path / part["file"]
        if not self.codec.compressed:
            return self.codec.open_part(path)
        if self._cached_name != part["file"]:
            self._cached = self.codec.load_part(path)
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
