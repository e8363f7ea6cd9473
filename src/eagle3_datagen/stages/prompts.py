"""Stage 1: raw chat records in their own format -> normalized, deduplicated prompts.

A prompt keeps the system message and the user turns of a conversation; the original
assistant turns are dropped because the target model regenerates them. Tool conversations
keep their declared tools and their recorded calls and results in OpenAI layout, with
Kimi's call ids: generation compares the regenerated calls with them and reuses the
results of those that match (docs/formats.md).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path

from eagle3_datagen.formats.datasets import normalize
from eagle3_datagen.formats.files import InputError, iter_jsonl, write_json, write_jsonl_zst
from eagle3_datagen.formats.sources import Source, resolve

# Stats keys `prefix:name` that are gathered into one {name: count} table each; `layout` (the layout
# `format: auto` read each record as) only where it is counted.
TABLES = {"ignored_field": "ignored_fields", "ignored_turn_field": "ignored_turn_fields", "layout": "detected_layouts"}
ALWAYS_TABLES = ("ignored_fields", "ignored_turn_fields")


def shard_of(prompt_id: str, shards: int) -> int:
    return int(prompt_id, 16) % shards


def prompt_ids(shard_paths: Iterable[str | Path]) -> set[str]:
    """The ids of the prompts in written shards (an earlier partition's)."""
    return {prompt["id"] for path in shard_paths for _, prompt in iter_jsonl(path)}


def partition_prompts(
    settings: dict, sources: Sequence[str], shard_paths: Sequence[str], stats_path: str, earlier_shards: Sequence[str]
) -> dict:
    """One partition's prompts from the prompts rule's `settings` (workflow.settings.prompt_settings, filled
    with the schema's defaults): its `source` (else the one of `sources`, the rule's input file) read as its
    subset, split and revision (the commit the workflow resolved that revision to, so the job reads what its
    params name)."""
    if not settings.get("source") and len(sources) != 1:
        raise InputError("--source", None, "no source", "name one source: --source PATH, or `source` in --settings")
    source = Source(
        settings.get("source") or sources[0],
        subset=settings.get("subset"),
        split=settings.get("split"),
        revision=settings.get("commit") or settings.get("revision"),
    )
    return build_prompts(
        source,
        settings["format"],
        shard_paths,
        stats_path,
        settings.get("system_prompt"),
        settings.get("max_prompts"),
        settings["max_bad_record_rate"],
        earlier_shards,
        allow_empty=settings["allow_empty"],
    )


def build_prompts(
    source: str | Path | Source,
    fmt: str,
    shard_paths: Sequence[str | Path],
    stats_path: str | Path,
    system_prompt: str | None = None,
    max_prompts: int | None = None,
    max_bad_record_rate: float = 0.0,
    earlier_shards: Sequence[str | Path] = (),
    allow_empty: bool = False,
) -> dict:
    """Normalize, deduplicate and shard one partition's source (formats/sources.py: a file, a glob, a
    directory, or a hub dataset as a `Source` with its subset, split and revision). Returns the stats
    written.

    Prompts already in `earlier_shards` (the earlier partitions', when the config drops prompts
    shared across partitions) are left out and counted. Nothing is written unless the whole source
    was read within `max_bad_record_rate`, and it gave a prompt or `allow_empty` is set.
    """
    spec = source if isinstance(source, Source) else Source(str(source))
    resolved = resolve(spec)
    stats: Counter = Counter()
    bad_examples: list[dict] = []
    seen: set[str] = set()
    earlier = prompt_ids(earlier_shards)
    shards: list[list[dict]] = [[] for _ in shard_paths]
    normalized = normalize(spec, fmt, system_prompt, stats, max_bad_record_rate, bad_examples, resolved)
    for prompt in normalized:
        if prompt["id"] in seen:
            stats["duplicates"] += 1
            continue
        if prompt["id"] in earlier:
            stats["shared_with_earlier_partitions"] += 1
            continue
        if max_prompts is not None and len(seen) >= max_prompts:
            stats["over_max_prompts"] += 1
            continue
        seen.add(prompt["id"])
        shards[shard_of(prompt["id"], len(shard_paths))].append(prompt)
    if not seen and not allow_empty:
        raise _empty(spec, resolved.parts, stats, bad_examples)
    for path, rows in zip(shard_paths, shards, strict=True):
        write_jsonl_zst(path, rows)
    prompts = [p for rows in shards for p in rows]
    counts = {k: v for k, v in stats.items() if k.partition(":")[0] not in TABLES}
    result = {
        "source": spec.source,
        **({"files": resolved.parts} if resolved.parts != [spec.source] else {}),
        **({"commit": resolved.commit} if resolved.commit else {}),
        "format": fmt,
        "prompts": len(seen),
        "per_shard": [len(rows) for rows in shards],
        "multi_turn": sum(1 for p in prompts if _user_turns(p) > 1),
        "with_tools": sum(1 for p in prompts if p.get("tools")),
        "recorded_tool_calls": sum(len(m.get("tool_calls") or ()) for p in prompts for m in p["messages"]),
        "recorded_tool_results": sum(1 for p in prompts for m in p["messages"] if m["role"] == "tool"),
        **dict(sorted(counts.items())),
        **{
            table: _table(stats, prefix)
            for prefix, table in TABLES.items()
            if table in ALWAYS_TABLES or _table(stats, prefix)
        },
    }
    if bad_examples:
        result["bad_record_examples"] = bad_examples
    write_json(stats_path, result)
    return result


# The stats keys that count records left out, which an empty partition's error names.
LEFT_OUT = ("skipped_", "bad_records", "duplicates", "shared_with_earlier_partitions")


def _empty(spec: Source, parts: list[str], stats: Counter, bad_examples: list[dict]) -> InputError:
    """Why a partition has no prompt: what was read, and what left out each record."""
    files = parts[0] if len(parts) == 1 else f"{len(parts)} files ({parts[0]}, ...)"
    reasons = ", ".join(f"{k}: {v}" for k, v in sorted(stats.items()) if k.startswith(LEFT_OUT))
    first = "; ".join(f"line {b['line']}: {b['reason']}" for b in bad_examples[:2])
    allow = "or set `allow_empty: true` on the partition if it may be empty"
    if not stats["records"]:
        return InputError(
            spec.source, None, f"no prompts: {files} holds no record", f"point `source` at the data, {allow}"
        )
    problem = f"no prompts: {stats['records']} records read from {files}, all left out ({reasons})"
    if first:
        problem += f"; first bad: {first}"
    if any(k.startswith(("skipped_", "bad_records")) for k in stats):
        fix = "set the partition's `format` to the records' layout (docs/formats.md)"
    else:
        fix = "give the partition records no other partition has (prompts.shared_across_partitions)"
    return InputError(spec.source, None, problem, f"{fix}, {allow}")


def _table(stats: Counter, prefix: str) -> dict:
    return dict(sorted((k.partition(":")[2], v) for k, v in stats.items() if k.partition(":")[0] == prefix))


def _user_turns(prompt: dict) -> int:
    return sum(1 for m in prompt["messages"] if m["role"] == "user")
