"""Conversations -> prompts: the layout chosen per record, calls linked with Kimi's ids, the turns a
prompt keeps, its content id, and one source read with every record counted."""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path

import orjson

from eagle3_datagen.chat.tool_calls import openai_call
from eagle3_datagen.formats.datasets import chats, toolcalls  # noqa: F401  (their layouts register)
from eagle3_datagen.formats.datasets.common import LAYOUTS, BadRecord, Parsed, SkipRecord
from eagle3_datagen.formats.files import InputError
from eagle3_datagen.formats.sources import Resolved, Source, iter_source, resolve

# A partition's `format`: a registered layout, or `auto` (each record's own, `detect_layout`).
LAYOUT_CHOICES = (*LAYOUTS, "auto")

# The reasons of records that are no JSON object (files.iter_jsonl), not records of another layout.
UNREADABLE = ("malformed JSON", "expected a JSON object")
# How many (line, reason) pairs of unreadable records the stats and the error quote.
BAD_EXAMPLES = 5


def detect_layout(record: dict) -> str | None:
    """The layout a record's keys name; None when they name none."""
    if "messages" in record:
        return "openai"
    if "conversations" in record:
        return "sharegpt"
    if "instruction" in record:
        return "alpaca"
    if "chat" in record:
        return "glaive"
    if "query" in record and "answers" in record:
        return "xlam"
    if "problem" in record and "solution" in record:
        return "problem_solution"
    if ("query" in record or "question" in record) and "answer" in record:
        return "query_answer"
    return None


def parse(record: dict, fmt: str) -> tuple[str, Parsed]:
    """(the layout read, the conversation); raises BadRecord when the record is not of that layout."""
    record_format = detect_layout(record) if fmt == "auto" else fmt
    if record_format is None:
        raise BadRecord(f"no known layout has the keys {sorted(record)}")
    try:
        return record_format, LAYOUTS[record_format].parse(record)
    except (KeyError, TypeError, AttributeError, ValueError) as exc:
        raise BadRecord(
            f"not a {record_format} record ({type(exc).__name__}: {exc}); it needs {LAYOUTS[record_format].needs}"
        ) from None


def link_tool_calls(messages: list[dict]) -> tuple[list[dict], str | None]:
    """Give recorded calls Kimi's ids and point each result at its call.

    A result names its call by the source's id, else it answers the earliest open call (of its
    `name`, when it has one). Returns the messages up to the first result that answers no open
    call, and that reason.
    """
    linked, open_calls, by_source_id, index = [], [], {}, 0
    for message in messages:
        if message.get("tool_calls"):
            calls = []
            for recorded in message["tool_calls"]:
                calls.append(openai_call(recorded["name"], recorded["arguments"], index))
                index += 1
                if recorded.get("id"):
                    by_source_id[recorded["id"]] = calls[-1]
            open_calls.extend(calls)
            linked.append({"role": "assistant", "content": message["content"], "tool_calls": calls})
        elif message["role"] == "tool":
            answered = by_source_id.get(message.get("tool_call_id")) or next(
                (c for c in open_calls if message.get("name") in (None, c["function"]["name"])), None
            )
            if answered not in open_calls:
                return linked, "tool_result_unmatched"
            open_calls.remove(answered)
            name = answered["function"]["name"]
            linked.append({"role": "tool", "tool_call_id": answered["id"], "name": name, "content": message["content"]})
        else:
            linked.append(message)
    return linked, None


def recorded_conversations(source: str | Path, fmt: str) -> Iterator[tuple[int, list[dict]]]:
    """(line, whole conversation) per record, assistant turns included and calls linked as prompts'
    are: what the demo models are fitted to answer."""
    for _, line_no, record in iter_source(resolve(Source(str(source)))):
        _, parsed = parse(record, fmt)
        messages, _ = link_tool_calls(parsed.messages)
        yield line_no, messages


def prompt_messages(messages: list[dict], system_prompt: str | None, notes: Counter | None = None) -> list[dict]:
    """Keep system and user turns, and recorded tool calls with their results; add a default system prompt.

    Text is kept as written. Plain assistant turns are dropped: the target model regenerates them.
    An empty system turn is dropped as a turn (counted in `notes`); an empty user turn skips the record.
    """
    kept = []
    for message in messages:
        role = message["role"]
        if role == "tool" or message.get("tool_calls"):
            if not any(m["role"] == "user" for m in kept):
                raise SkipRecord("tool_call_before_user")
            kept.append(message)
            continue
        if role == "assistant":
            continue
        content = message["content"]
        if not content.strip():
            if role == "system":
                if notes is not None:
                    notes["dropped_empty_system_turn"] += 1
                continue
            raise SkipRecord("empty_turn")
        if role == "system":
            if kept:
                raise SkipRecord("system_not_first")
            kept.append({"role": "system", "content": content})
        else:
            kept.append({"role": "user", "content": content})
    if not any(m["role"] == "user" for m in kept):
        raise SkipRecord("no_user_turn")
    if system_prompt and kept[0]["role"] != "system":
        kept.insert(0, {"role": "system", "content": system_prompt})
    return kept


def conversation_id(messages: Sequence[dict], tools: Sequence[dict] | None = None) -> str:
    """Stable content id of the prompt's messages (recorded calls and results included) and tools: equal
    prompts get equal ids, which is also how duplicates are found."""
    canonical = orjson.dumps({"tools": tools or [], "messages": messages}, option=orjson.OPT_SORT_KEYS)
    return hashlib.sha256(canonical).hexdigest()[:24]


def normalize(
    source: str | Path | Source,
    fmt: str,
    system_prompt: str | None,
    stats: Counter,
    max_bad_record_rate: float = 0.0,
    bad_examples: list | None = None,
    resolved: Resolved | None = None,
) -> Iterator[dict]:
    """Yield normalized prompts from `source` (sources.py: a file, a glob, a directory or a hub id) in
    source order, counting what is skipped, cut, dropped and ignored in `stats`, and with `format: auto`
    the layout each record was read as (`layout:<name>`, `layout:unknown`).

    A record that is not of the layout, or a line that is not a JSON object, is counted (`bad_records`,
    its line and reason in `bad_examples`); once the whole source is read, more of them than
    `max_bad_record_rate` of the records raises InputError naming the first ones. Callers write nothing
    before the end. `resolved`: the source's files, when the caller resolved it already.
    """
    spec = source if isinstance(source, Source) else Source(str(source))
    if fmt not in LAYOUT_CHOICES:
        raise InputError(spec.source, None, f"unknown format {fmt!r}", f"use one of {', '.join(LAYOUT_CHOICES)}")
    resolved = resolved or resolve(spec)
    single = resolved.parts == [spec.source]
    bad = bad_examples if bad_examples is not None else []

    def count_bad(file: str, line_no: int, reason: str) -> None:
        stats["bad_records"] += 1
        if len(bad) < BAD_EXAMPLES:
            where = {"line": line_no} if single else {"file": file, "line": line_no}
            bad.append({**where, "reason": reason})

    def unreadable(file: str, line_no: int, reason: str) -> None:
        """A line that is no JSON object: a record, and a bad one."""
        stats["records"] += 1
        count_bad(file, line_no, reason)

    for file, line_no, record in iter_source(resolved, unreadable):
        stats["records"] += 1
        if fmt == "auto":
            stats[f"layout:{detect_layout(record) or 'unknown'}"] += 1
        try:
            record_format, parsed = parse(record, fmt)
        except BadRecord as exc:
            count_bad(file, line_no, str(exc))
            continue
        except SkipRecord as skip:
            stats[f"skipped_{skip.reason}"] += 1
            continue
        try:
            messages, unmatched = link_tool_calls(parsed.messages)
            messages = prompt_messages(messages, system_prompt, parsed.notes)
        except SkipRecord as skip:
            stats[f"skipped_{skip.reason}"] += 1
            continue
        finally:
            stats.update(parsed.notes)
        for cut in filter(None, (parsed.cut, unmatched)):
            stats[f"cut_{cut}"] += 1
        source_info = {"file": file, "line": line_no, "format": record_format}
        if record.get("id") is not None:
            source_info["id"] = str(record["id"])
        prompt = {"id": conversation_id(messages, parsed.tools), "messages": messages, "source": source_info}
        if parsed.tools:
            prompt["tools"] = parsed.tools
        yield prompt
    _check_bad_rate(spec.source, fmt, stats, bad, max_bad_record_rate)


def _check_bad_rate(source, fmt: str, stats: Counter, bad: list, max_rate: float) -> None:
    if not (stats["bad_records"] and stats["bad_records"] > max_rate * stats["records"]):
        return
    examples = "; ".join(f"{b['file'] + ' ' if 'file' in b else ''}line {b['line']}: {b['reason']}" for b in bad)
    count = f"{stats['bad_records']} of {stats['records']} records could not be read"
    rate = f"(allowed: {max_rate:.2%})"
    raise_rate = "raise the partition's max_bad_record_rate to drop them"
    first = bad[0]
    if first["reason"].startswith(UNREADABLE):  # the file's text, not the layout, is at fault
        problem = f"{first['reason']}; {count} {rate}" + (f"; first: {examples}" if len(bad) > 1 else "")
        whole = "one complete JSON object" if first["reason"].startswith(UNREADABLE[0]) else "one JSON object"
        fix = f"make each line {whole}, or {raise_rate}"
    else:
        problem = f"{count} as {fmt!r} {rate}; first: {examples}"
        choices = ", ".join(LAYOUT_CHOICES)
        fix = f"set the partition's format to the dataset's layout (one of {choices}), or {raise_rate}"
    raise InputError(first.get("file", source), first["line"], problem, fix)
