"""Stage 1: raw chat records in their own format -> normalized, deduplicated prompts.

A prompt keeps the system message and the user turns of a conversation; the original
assistant turns are dropped because the target model regenerates them. A conversation
is cut before its first tool message, since a tool result answers the original
assistant's call, not the regenerated one.
"""

from __future__ import annotations

import hashlib
import re
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import orjson

from .io import InputError, iter_records, write_json, write_jsonl_zst

SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "bing": "assistant",
    "model": "assistant",
    "system": "system",
    "function_call": "tool",
    "observation": "tool",
    "tool": "tool",
    "function": "tool",
}
OPENAI_ROLES = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "assistant": "assistant",
    "tool": "tool",
    "function": "tool",
}
GLAIVE_MARKERS = re.compile(r"(USER:|ASSISTANT:|FUNCTION RESPONSE:)")
GLAIVE_ROLES = {"USER:": "user", "ASSISTANT:": "assistant", "FUNCTION RESPONSE:": "tool"}


class SkipRecord(Exception):
    """A record that is valid input but yields no prompt; the reason is counted."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def _text(content) -> str:
    """OpenAI content may be a string or a list of typed parts; keep the text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    raise SkipRecord("unsupported_content")


def _parse_turns(record: dict, list_key: str, role_key: str, content_key: str, roles: dict) -> list[dict]:
    turns = record.get(list_key)
    if not isinstance(turns, list):
        raise KeyError(list_key)
    messages = []
    for turn in turns:
        role = roles.get(str(turn.get(role_key, "")).lower())
        if role is None:
            raise SkipRecord("unknown_role")
        messages.append({"role": role, "content": _text(turn.get(content_key))})
    return messages


def parse_sharegpt(record: dict) -> list[dict]:
    return _parse_turns(record, "conversations", "from", "value", SHAREGPT_ROLES)


def parse_openai(record: dict) -> list[dict]:
    return _parse_turns(record, "messages", "role", "content", OPENAI_ROLES)


def parse_alpaca(record: dict) -> list[dict]:
    instruction = record["instruction"]
    extra = record.get("input") or ""
    user = f"{instruction}\n\n{extra}" if extra.strip() else instruction
    messages = [{"role": "user", "content": user}, {"role": "assistant", "content": record.get("output") or ""}]
    if record.get("system"):
        messages.insert(0, {"role": "system", "content": record["system"]})
    return messages


def parse_glaive(record: dict) -> list[dict]:
    chat = record["chat"]
    messages = []
    system = (record.get("system") or "").strip()
    if system:
        messages.append({"role": "system", "content": system.removeprefix("SYSTEM:").strip()})
    pieces = GLAIVE_MARKERS.split(chat)
    for marker, body in zip(pieces[1::2], pieces[2::2], strict=True):
        body = body.replace("<|endoftext|>", "").strip()
        messages.append({"role": GLAIVE_ROLES[marker], "content": body})
    return messages


PARSERS: dict[str, Callable[[dict], list[dict]]] = {
    "sharegpt": parse_sharegpt,
    "openai": parse_openai,
    "alpaca": parse_alpaca,
    "glaive": parse_glaive,
}
FORMATS = (*PARSERS, "auto")
REQUIRED_KEYS = {
    "sharegpt": "conversations",
    "openai": "messages",
    "alpaca": "instruction and output",
    "glaive": "chat",
}


def detect_format(record: dict) -> str | None:
    if "messages" in record:
        return "openai"
    if "conversations" in record:
        return "sharegpt"
    if "instruction" in record:
        return "alpaca"
    if "chat" in record:
        return "glaive"
    return None


def prompt_messages(messages: list[dict], system_prompt: str | None) -> list[dict]:
    """Keep system and user turns up to the first tool message; add a default system prompt."""
    kept = []
    for message in messages:
        role = message["role"]
        if role == "tool":
            break
        if role == "assistant":
            continue
        content = message["content"].strip()
        if not content:
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


def conversation_id(messages: Sequence[dict]) -> str:
    """Stable content id: equal prompts get equal ids, which is also how duplicates are found."""
    canonical = orjson.dumps([[m["role"], m["content"]] for m in messages])
    return hashlib.sha256(canonical).hexdigest()[:24]


def shard_of(prompt_id: str, shards: int) -> int:
    return int(prompt_id, 16) % shards


def normalize(source: str | Path, fmt: str, system_prompt: str | None, stats: Counter) -> Iterator[dict]:
    """Yield normalized prompts from `source` in source order, counting what is skipped."""
    if fmt not in FORMATS:
        raise InputError(source, None, f"unknown format {fmt!r}", f"use one of {', '.join(FORMATS)}")
    for line_no, record in iter_records(source):
        stats["records"] += 1
        record_format = detect_format(record) if fmt == "auto" else fmt
        if record_format is None:
            raise InputError(
                source,
                line_no,
                f"cannot detect the format from keys {sorted(record)}",
                f"set the partition's format to one of {', '.join(PARSERS)}",
            )
        try:
            messages = prompt_messages(PARSERS[record_format](record), system_prompt)
        except SkipRecord as skip:
            stats[f"skipped_{skip.reason}"] += 1
            continue
        except (KeyError, TypeError, AttributeError) as exc:
            raise InputError(
                source,
                line_no,
                f"not a {record_format} record ({type(exc).__name__}: {exc})",
                f"a {record_format} record needs {REQUIRED_KEYS[record_format]}; check the partition's format",
            ) from None
        source_info = {"file": str(source), "line": line_no, "format": record_format}
        if record.get("id") is not None:
            source_info["id"] = str(record["id"])
        yield {"id": conversation_id(messages), "messages": messages, "source": source_info}


def build_prompts(
    source: str | Path,
    fmt: str,
    shard_paths: Sequence[str | Path],
    stats_path: str | Path,
    system_prompt: str | None = None,
    max_prompts: int | None = None,
) -> dict:
    """Normalize, deduplicate and shard one partition's source. Returns the stats written."""
    stats: Counter = Counter()
    seen: set[str] = set()
    shards: list[list[dict]] = [[] for _ in shard_paths]
    for prompt in normalize(source, fmt, system_prompt, stats):
        if prompt["id"] in seen:
            stats["duplicates"] += 1
            continue
        if max_prompts is not None and len(seen) >= max_prompts:
            stats["over_max_prompts"] += 1
            continue
        seen.add(prompt["id"])
        shards[shard_of(prompt["id"], len(shard_paths))].append(prompt)
    for path, rows in zip(shard_paths, shards, strict=True):
        write_jsonl_zst(path, rows)
    result = {
        "source": str(source),
        "format": fmt,
        "prompts": len(seen),
        "per_shard": [len(rows) for rows in shards],
        "multi_turn": sum(1 for rows in shards for p in rows if _user_turns(p) > 1),
        **dict(sorted(stats.items())),
    }
    write_json(stats_path, result)
    return result


def _user_turns(prompt: dict) -> int:
    return sum(1 for m in prompt["messages"] if m["role"] == "user")
