"""What a run's hidden states take on disk, and which copy of them stays.

Per partition: the tokens its samples hold (measured by the tokens stage's audits once they exist; before
that counted from the responses' usage; before those an upper bound from the prompts: their bytes and the
max tokens per turn; before the prompts exist, a first run's, an estimate from the source's records; each
sample at most tokens.max_length), the bytes
of its shards and of each export (formats/storage.py), the most they take at once (shards and exports
side by side) and what stays (the exports alone where the shards are released: `released_partitions`),
and the room on the filesystem each output goes to: its free space, or less where a quota
(workflow/quota.py) or `resources.disk_quota_bytes` leaves less. The preflight checks a run's bytes with
it before any job, without a plan, and each capture job its own shard's before it writes; the plan prints
them. Torch-free: the Snakefile imports it.
"""

from __future__ import annotations

import math
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import orjson

from eagle3_datagen.backends.service import launch_args
from eagle3_datagen.formats import sources, storage
from eagle3_datagen.formats.checkpoint import text_config
from eagle3_datagen.formats.files import InputError, iter_jsonl, read_json
from eagle3_datagen.formats.trainer_exports import EXPORTS, TrainerExport
from eagle3_datagen.workflow import quota
from eagle3_datagen.workflow.partitions import (
    baseline_partitions,
    inference_backend,
    partition_config,
    prompt_partition,
    shard_names,
)
from eagle3_datagen.workflow.settings import DATASET

# Tokens per message and per prompt that a chat template adds around the text (role markers, a default
# system prompt), beyond the text's own: the prompts' bound counts at most one token per byte of text.
TEMPLATE_TOKENS_PER_MESSAGE = 32
TEMPLATE_TOKENS_PER_PROMPT = 64
# A first run's estimate counts a source record's JSON bytes at this many per token: BPE tokenizers take
# about 4 bytes of English text a token, fewer of code and other scripts; a record's keys and quoting
# count as text (on the demo the estimate comes out 2.6-6.8x the bytes written: bench/disk_basis.py).
SOURCE_BYTES_PER_TOKEN = 3


def hidden_size(config: dict) -> int:
    """The model's hidden size: its directory's config.json's, else `plan.model.hidden_size` (or the settings
    of a demo's model that is not built yet)."""
    path = Path(config["model"]["path"]) / "config.json"
    model = text_config(config["model"]["path"]) if path.exists() else {}
    if "hidden_size" in model:
        return model["hidden_size"]
    # no default: the model directory's config.json says it, or the demo's own settings
    shape = config["plan"].get("model") or config.get("demo")
    if not shape or "hidden_size" not in shape:
        raise FileNotFoundError(f"{path} does not give the model's hidden size: give plan.model.hidden_size instead")
    return shape["hidden_size"]


def stored_states(config: dict) -> storage.States:
    """What the config's shards store, sized from the model's hidden size (`auto`: EAGLE-3's three auxiliary
    layers)."""
    spec = config["hidden_states"]["aux_layers"]
    aux_layers = 3 if spec == "auto" else len(spec)
    return storage.States.from_settings(config["hidden_states"], aux_layers, hidden_size(config))


def exported_formats(config: dict, partition: str) -> list[str]:
    """The exports made of a partition's shards: `export.formats`, or a baseline twin's SpecForge export
    (the evaluate stage's)."""
    return list(config["export"]["formats"]) if partition in config["partitions"] else ["specforge"]


def released_partitions(config: dict) -> list[str]:
    """The partitions whose shards' parts are removed once their exports and probes are done
    (`hidden_states.keep_shards: false`): those with an export, which is then the one copy of the states."""
    if config["hidden_states"]["keep_shards"]:
        return []
    partitions = [p for p in sorted(config["partitions"]) if config["export"]["formats"]]
    return partitions + baseline_partitions(config)


def hidden_readers(config: dict, partition: str) -> list[str]:
    """What is made of a partition's shard parts: its probes and its exports (the report reads index.json only)."""
    probes = [f"results/{partition}/probe/{s}.json" for s in shard_names(config, partition)]
    exports = [f"results/{partition}/export/{fmt}" for fmt in exported_formats(config, partition)]
    return (probes if partition in config["partitions"] else []) + exports


@dataclass
class Tokens:
    """A partition's samples and their tokens, and how they are known."""

    tokens: int
    samples: int
    basis: str  # measured | upper bound | estimate ...


def measured_tokens(config: dict, partition: str, results: Path) -> Tokens | None:
    """What the tokens stage wrote (its audits' counts), once every shard's exists."""
    tokens = samples = 0
    for shard in shard_names(config, partition):
        path = results / partition / "tokens" / f"{shard}.audit.json"
        if not path.is_file():
            return None
        counts = read_json(path)["counts"]
        tokens += counts.get("tokens", 0)
        samples += counts.get("samples_out", 0)
    return Tokens(tokens, samples, "measured (token shards)")


def max_turn_tokens(config: dict, partition: str) -> int:
    """The most tokens one regenerated turn may have: the sampling's, the backend's own or its largest tier's."""
    inference = config["inference"]
    backend = inference_backend(config, partition)
    limits = [inference["sampling"]["max_new_tokens"]]
    section = inference.get(backend) or {}
    if section.get("max_tokens"):
        limits.append(section["max_tokens"])
    limits += [tier["max_tokens"] for tier in (section.get("tiers") or {}).values() if tier.get("max_tokens")]
    return max(limits)


def bounded_tokens(config: dict, partition: str, results: Path) -> Tokens | None:
    """An upper bound on the tokens of a partition's samples, from its prompt shards (None before they
    exist): each sample at most tokens.max_length, and at most one token per byte of the prompt's text
    and tools (a byte-level tokenizer's tokens are each at least one byte), the template's own tokens, and
    the max tokens of every regenerated turn (a row's user turns and recorded tool-call turns; a
    `dataset` twin's turns are the records' own, bounded by max_length alone)."""
    max_length = config["tokens"]["max_length"]
    every_turn = config["tokens"]["thinking"] == "keep_all"  # one sample per assistant turn
    per_turn = max_turn_tokens(config, partition)
    own_answers = inference_backend(config, partition) == DATASET
    tokens = samples = 0
    for shard in shard_names(config, partition):
        path = results / prompt_partition(partition) / "prompts" / f"{shard}.jsonl.zst"
        if not path.is_file():
            return None
        for _, prompt in iter_jsonl(path):
            messages = prompt["messages"]
            # a user turn is answered, and a recorded tool call answered again after its result
            turns = sum(m["role"] == "user" or bool(m.get("tool_calls")) for m in messages)
            text = sum(len(orjson.dumps(m)) for m in messages) + len(orjson.dumps(prompt.get("tools") or []))
            template = TEMPLATE_TOKENS_PER_PROMPT + TEMPLATE_TOKENS_PER_MESSAGE * (len(messages) + turns)
            sample = max_length if own_answers else min(max_length, text + template + turns * per_turn)
            count = max(1, turns) if every_turn else 1
            tokens += count * sample
            samples += count
    return Tokens(tokens, samples, "upper bound (prompts, max tokens per turn)")


def responded_tokens(config: dict, partition: str, results: Path) -> Tokens | None:
    """The tokens of a partition's samples counted from its response shards (None before every one exists):
    a sample per answered row (per assistant turn with tokens.thinking: keep_all), an answer the model gave
    counted by its usage (its prompt's tokens and its own: the conversation up to its end), one without
    (a `dataset` twin's, the record's own) estimated as a first run's: the conversation's JSON bytes at
    SOURCE_BYTES_PER_TOKEN and the template's tokens; at most tokens.max_length a sample."""
    max_length = config["tokens"]["max_length"]
    every_turn = config["tokens"]["thinking"] == "keep_all"
    tokens = samples = 0
    for shard in shard_names(config, partition):
        path = results / partition / "responses" / f"{shard}.jsonl.zst"
        if not path.is_file():
            return None
        for _, row in iter_jsonl(path):
            if row.get("status") == "failed":
                continue
            messages = row["messages"]
            answers = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
            for end in answers if every_turn else answers[-1:]:
                usage = messages[end].get("usage") or {}
                if usage.get("prompt_tokens") is not None and usage.get("completion_tokens") is not None:
                    sample = usage["prompt_tokens"] + usage["completion_tokens"]
                else:
                    text = sum(len(orjson.dumps(m)) for m in messages[: end + 1])
                    sample = math.ceil(text / SOURCE_BYTES_PER_TOKEN) + TEMPLATE_TOKENS_PER_PROMPT
                tokens += min(max_length, sample)
                samples += 1
    return Tokens(tokens, samples, "counted (responses' usage)")


def estimated_tokens(config: dict, partition: str) -> Tokens | None:
    """A first run's estimate of a partition's tokens, before its prompts exist: one sample per record of
    its source (the first `max_prompts`), each of the record's JSON bytes at SOURCE_BYTES_PER_TOKEN, the
    template's tokens and one regenerated turn's max tokens (a `dataset` twin's answers are the record's
    own), at most tokens.max_length. None where the source cannot be read here (the prompts job says why)."""
    settings = partition_config(config, partition)
    max_length = config["tokens"]["max_length"]
    per_turn = 0 if inference_backend(config, partition) == DATASET else max_turn_tokens(config, partition)
    limit = settings.get("max_prompts")
    source = sources.Source(settings["source"], settings.get("subset"), settings.get("split"), settings.get("revision"))
    tokens = samples = 0
    try:
        for _, _, record in sources.iter_source(sources.resolve(source)):
            text = math.ceil(len(orjson.dumps(record)) / SOURCE_BYTES_PER_TOKEN)
            tokens += min(max_length, text + TEMPLATE_TOKENS_PER_PROMPT + per_turn)
            samples += 1
            if samples == limit:
                break
    except (InputError, OSError):
        return None
    return Tokens(tokens, samples, "estimate (source records, max tokens per turn)")


def observed_shard_ratio(
    results: Path, dtype: str, compress: str, level: int, partition: str | None = None
) -> tuple[float, str]:
    """On-disk over raw bytes of the finished shards stored as `dtype` and `compress` at `level` (released
    ones too: their index.json stays): the partition's own, else every partition's, else the assumed one."""
    if compress == "none":
        return 1.0, "uncompressed"
    where = [("*/hidden/*/index.json", "observed on finished shards")]
    if partition is not None:
        where.insert(0, (f"{partition}/hidden/*/index.json", "observed on the partition's finished shards"))
    for pattern, basis in where:
        on_disk = raw = 0
        for path in results.glob(pattern):
            index = read_json(path)
            stored = index.get("compress") or {}
            if (index["dtype"], stored.get("codec", "none"), stored.get("level", level)) == (dtype, compress, level):
                on_disk += index.get("bytes", 0)
                raw += index.get("raw_bytes", 0)
        if raw:
            return on_disk / raw, basis
    return storage.assumed_shard_ratio(dtype, compress, level), "assumed"


def observed_gzip_ratio(results: Path, states: storage.States, export: TrainerExport) -> tuple[float, str]:
    """On-disk over raw bytes of an export's finished gzipped samples, else the assumed one."""
    on_disk = raw = 0
    for path in results.glob(f"*/export/{export.name}/export.json"):
        rows = read_json(path).get("rows") or {}
        if rows.get("compress") == "gzip":
            on_disk += rows["bytes"]
            raw += rows["raw_bytes"]
    if raw:
        return on_disk / raw, "observed on finished exports"
    return states.assumed_gzip_ratio(export.files), "assumed"


@dataclass
class PartitionBytes:
    """A partition's outputs of the states on disk: its shards, each export, at most at once and at the end."""

    partition: str
    tokens: Tokens
    bf16: int  # the states' bytes in bf16: what one copy is measured against
    shards: int
    exports: dict[str, int]
    released: bool  # the shards' parts are removed once the exports are done
    basis: list[str] = field(default_factory=list)

    @property
    def peak(self) -> int:
        return self.shards + sum(self.exports.values())

    @property
    def end(self) -> int:
        return sum(self.exports.values()) + (0 if self.released else self.shards)

    def as_dict(self) -> dict:
        return {
            "partition": self.partition,
            "tokens": self.tokens.tokens,
            "samples": self.tokens.samples,
            "tokens_basis": self.tokens.basis,
            "bf16_bytes": self.bf16,
            "shard_bytes": self.shards,
            "export_bytes": self.exports,
            "peak_bytes": self.peak,
            "end_bytes": self.end,
            "shards_released": self.released,
            "basis": self.basis,
        }


def stored_shard_bytes(
    states: storage.States, hidden: dict, tokens: Tokens, shards: int, results: Path, partition: str
) -> tuple[int, float, str]:
    """The bytes of `shards` shards holding `tokens`, compressed at the observed or assumed ratio; the ratio
    and its basis."""
    ratio, basis = observed_shard_ratio(
        results, hidden["dtype"], hidden["compress"], hidden["compress_level"], partition
    )
    per_token = storage.shard_bytes_per_token(
        states.dtype, states.scales, states.scale_block, states.aux_layers, states.hidden_size
    )
    parts = math.ceil(tokens.tokens * per_token / hidden["shard_bytes"]) + shards
    return states.shard_bytes(tokens.tokens, tokens.samples, parts, ratio, shards), ratio, basis


def partition_bytes(config: dict, partition: str, tokens: Tokens, results: Path) -> PartitionBytes:
    """The bytes of a partition's shards and exports for `tokens`, compressed at the observed or assumed ratios."""
    states = stored_states(config)
    hidden = config["hidden_states"]
    shards = len(shard_names(config, partition))
    shard_bytes, ratio, ratio_basis = stored_shard_bytes(states, hidden, tokens, shards, results, partition)
    basis = [f"shards: {states.dtype} {hidden['compress']} x {ratio:.3f} ({ratio_basis})"]
    exports = {}
    for fmt in exported_formats(config, partition):
        export, gzip_ratio = EXPORTS[fmt], None
        if export.gzipped(config):
            gzip_ratio, gzip_basis = observed_gzip_ratio(results, states, export)
            basis.append(f"{fmt}: gzip x {gzip_ratio:.3f} ({gzip_basis})")
        exports[fmt] = states.export_bytes(export.files, tokens.tokens, tokens.samples, gzip_ratio)
    return PartitionBytes(
        partition=partition,
        tokens=tokens,
        bf16=tokens.tokens * states.bf16_bytes_per_token,
        shards=shard_bytes,
        exports=exports,
        released=partition in released_partitions(config),
        basis=basis,
    )


def staged_bytes_per_token(config: dict, states: storage.States) -> int:
    """A one-pass server's file per token: the auxiliary layers and layer N at the server's dtype (its
    `--dtype` flag; absent, a GPU's bf16)."""
    args = launch_args((config["inference"].get("vllm") or {}).get("launch") or {})
    dtype = args[args.index("--dtype") + 1] if "--dtype" in args[:-1] else "bfloat16"
    return (states.aux_layers + 1) * states.hidden_size * (4 if dtype in ("float32", "float") else 2)


def existing_bytes(path: Path) -> int:
    """Bytes of the files under `path` (0 when it does not exist): what a job that rewrites it frees first."""
    if not path.exists():
        return 0
    if path.is_file():
        return path.stat().st_size
    return sum(os.path.getsize(os.path.join(root, name)) for root, _, names in os.walk(path) for name in names)


def filesystem(path: Path) -> tuple[int, Path]:
    """(device, mount point) of the filesystem `path` is or will be written to."""
    existing = path.resolve()
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    mount = existing
    while not os.path.ismount(mount):
        mount = mount.parent
    return os.stat(existing).st_dev, mount


@dataclass(frozen=True)
class Room:
    """What can still be written to a filesystem before a write fails, and what says so."""

    left: int
    said: str  # completes "N GiB are ...": "free on the filesystem at /scratch", "left by ..."

    def __str__(self) -> str:
        return f"{self.left / 2**30:,.1f} GiB are {self.said}"


def room(where: Path, results: Path, stated_quota: int | None, environ: dict[str, str] | None = None) -> Room:
    """The room for writes to `where`: the smallest of its filesystem's free space, what the user's or their
    groups' quota leaves there (the quota tools on `environ`'s PATH), and what `resources.disk_quota_bytes`
    (`stated_quota`, a cap on what results/ holds) leaves."""
    _, mount = filesystem(where)
    found = [Room(shutil.disk_usage(mount).free, f"free on the filesystem at {mount}")]
    reported = quota.quota_left(mount, environ)
    if reported is not None:
        found.append(Room(reported.left, f"left by {reported.said} on the filesystem at {mount}"))
    if stated_quota is not None:
        held = existing_bytes(results)
        found.append(
            Room(
                max(0, stated_quota - held),
                f"left of resources.disk_quota_bytes ({stated_quota / 2**30:,.1f} GiB, of which {results} "
                f"holds {held / 2**30:,.1f} GiB)",
            )
        )
    return min(found, key=lambda r: r.left)


@dataclass
class FilesystemNeed:
    """The bytes a run writes onto one filesystem, against the room there."""

    where: Path
    room: Room
    needed: int = 0
    partitions: list[str] = field(default_factory=list)

    @property
    def exceeded(self) -> bool:
        return self.needed > self.room.left


def needs_by_filesystem(
    writes: list[tuple[str, Path, int]],
    results: Path,
    stated_quota: int | None = None,
    environ: dict[str, str] | None = None,
) -> list[FilesystemNeed]:
    """`writes` (partition, output path, bytes) grouped by the filesystem each path goes to."""
    found: dict[int, FilesystemNeed] = {}
    for partition, path, size in writes:
        device, mount = filesystem(path)
        if device not in found:
            found[device] = FilesystemNeed(mount, room(path, results, stated_quota, environ))
        need = found[device]
        need.needed += size
        if partition not in need.partitions:
            need.partitions.append(partition)
    return list(found.values())


def capture_room_problem(
    tokens_path: Path, out: Path, settings: dict, environ: dict[str, str] | None = None
) -> str | None:
    """What a capture job checks before it writes anything: its shard's bytes (from the tokens stage's
    audit of its token shard, beside it) against the room where `out` goes; a line naming the path, the
    bytes and the room, or None when it fits (or the audit is missing: nothing to count)."""
    audit = tokens_path.with_name(tokens_path.name.removesuffix(".jsonl.zst") + ".audit.json")
    if not audit.is_file():
        return None
    counts = read_json(audit)["counts"]
    tokens = Tokens(counts.get("tokens", 0), counts.get("samples_out", 0), "measured (token shard)")
    hidden, results = settings["hidden_states"], out.parent.parent.parent
    shape = {"model": settings["model"], "plan": {}, "hidden_states": hidden}
    states = stored_states(shape)
    needed, ratio, basis = stored_shard_bytes(states, hidden, tokens, 1, results, out.parent.parent.name)
    needed -= existing_bytes(out)
    left = room(out, results, settings.get("disk_quota_bytes"), environ)
    if needed <= left.left:
        return None
    return (
        f"the hidden-state shard {out} needs about {needed / 2**30:,.2f} GiB ({tokens.tokens:,} tokens measured "
        f"in {audit}, {states.dtype} {hidden['compress']} x {ratio:.3f}, {basis}), but {left}: nothing was "
        "written. Free space or quota there, store the states smaller (hidden_states.dtype, compress), or put "
        "results/ on a larger disk, and rerun"
    )
