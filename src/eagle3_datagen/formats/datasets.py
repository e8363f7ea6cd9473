"""Raw chat datasets in their own layouts -> conversations in OpenAI layout, and prompts from them.

A prompt keeps the system message and the user turns of a conversation; the original
assistant turns are dropped because the target model regenerates them. Tool conversations
keep their declared tools and their recorded calls and results in OpenAI layout, with
Kimi's call ids: generation compares the regenerated calls with them and reuses the
results of those that match (docs/formats.md).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import orjson

from eagle3_datagen.chat.tool_calls import openai_call, openai_tool
from eagle3_datagen.formats.files import InputError, iter_records

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
    "function_call": "assistant",
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


GLAIVE_CALL = "<functioncall>"


# glaive writes a call's arguments as a single-quoted JSON string: {"name": "f", "arguments": '{"a": 1}'}
GLAIVE_QUOTED_CALL = re.compile(
    r"""^\{\s*"name"\s*:\s*"(?P<name>[^"]+)"\s*,\s*"arguments"\s*:\s*'(?P<arguments>.*)'\s*\}$""", re.S
)


class SkipRecord(Exception):
    """A record that is valid input but yields no prompt; the reason is counted."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


@dataclass
class Parsed:
    """A record's conversation in OpenAI layout (calls with their source ids, not yet Kimi's)."""

    messages: list[dict]
    tools: list[dict] | None = None
    cut: str | None = None  # why the conversation ends before the record's does (counted)


def _text(content) -> str:
    """OpenAI content may be a string or a list of typed parts; keep the text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    raise SkipRecord("unsupported_content")


def _json_value(value):
    """A value that may arrive JSON-encoded as a string (ShareGPT tools, OpenAI arguments)."""
    if isinstance(value, str):
        try:
            return orjson.loads(value)
        except orjson.JSONDecodeError:
            raise SkipRecord("tool_json_unparsed") from None
    return value


def _tools(value) -> list[dict] | None:
    definitions = _json_value(value) if value else None
    if not definitions:
        return None
    try:
        return [openai_tool(d) for d in definitions]
    except (ValueError, TypeError, AttributeError):
        raise SkipRecord("tool_definition_unparsed") from None


def _call(name, arguments, source_id=None) -> dict:
    """A recorded call, its arguments as compact JSON text.

    Raises SkipRecord when its name or arguments cannot be read; the parsers then cut the
    conversation before that turn (`cut_tool_call_unparsed`).
    """
    if not isinstance(name, str) or not name:
        raise SkipRecord("tool_call_unparsed")
    arguments = _json_value(arguments if arguments is not None else {})
    return {"id": source_id, "name": name, "arguments": orjson.dumps(arguments).decode()}


def _openai_calls(message: dict) -> list[dict]:
    calls = [
        _call(c["function"]["name"], c["function"].get("arguments"), c.get("id"))
        for c in message.get("tool_calls") or ()
    ]
    if message.get("function_call"):  # the legacy single call
        calls.append(_call(message["function_call"]["name"], message["function_call"].get("arguments")))
    return calls


def _sharegpt_calls(value: str) -> list[dict]:
    calls = _json_value(value)
    calls = calls if isinstance(calls, list) else [calls]
    return [_call(c.get("name"), c.get("arguments")) for c in calls]


def _parse_turns(record: dict, list_key: str, role_key: str, content_key: str, roles: dict) -> Parsed:
    turns = record.get(list_key)
    if not isinstance(turns, list):
        raise KeyError(list_key)
    messages = []
    for turn in turns:
        source_role = str(turn.get(role_key, "")).lower()
        role = roles.get(source_role)
        if role is None:
            raise SkipRecord("unknown_role")
        message = {"role": role, "content": _text(turn.get(content_key))}
        try:
            if source_role == "function_call":
                message.update(content="", tool_calls=_sharegpt_calls(turn.get(content_key)))
            elif role == "assistant" and (turn.get("tool_calls") or turn.get("function_call")):
                message["tool_calls"] = _openai_calls(turn)
        except (SkipRecord, KeyError, TypeError, AttributeError):
            return Parsed(messages, cut="tool_call_unparsed")
        if role == "tool":
            message.update({k: turn[k] for k in ("tool_call_id", "name") if turn.get(k)})
        messages.append(message)
    return Parsed(messages)


def parse_sharegpt(record: dict) -> Parsed:
    parsed = _parse_turns(record, "conversations", "from", "value", SHAREGPT_ROLES)
    parsed.tools = _tools(record.get("tools"))
    return parsed


def parse_openai(record: dict) -> Parsed:
    parsed = _parse_turns(record, "messages", "role", "content", OPENAI_ROLES)
    parsed.tools = _tools(record.get("tools") or record.get("functions"))
    return parsed


def parse_alpaca(record: dict) -> Parsed:
    instruction = record["instruction"]
    extra = record.get("input") or ""
    user = f"{instruction}\n\n{extra}" if extra.strip() else instruction
    messages = [{"role": "user", "content": user}, {"role": "assistant", "content": record.get("output") or ""}]
    if record.get("system"):
        messages.insert(0, {"role": "system", "content": record["system"]})
    return Parsed(messages)


def glaive_system(system: str) -> tuple[str, list[dict] | None]:
    """glaive's system prompt -> its prose and the function definitions (JSON objects) after it."""
    text = system.strip().removeprefix("SYSTEM:").strip()
    start = text.find("{")
    if start < 0:
        return text, None
    decoder, definitions, at = json.JSONDecoder(), [], start
    try:
        while at < len(text):
            definition, at = decoder.raw_decode(text, at)
            definitions.append(definition)
            at = len(text) - len(text[at:].lstrip())
    except json.JSONDecodeError:
        raise SkipRecord("tool_definition_unparsed") from None
    # The prose introduces the list ("... Use them if required -"); the template declares the tools.
    return text[:start].rstrip().removesuffix("-").rstrip(), _tools(definitions)


def glaive_call(text: str) -> dict | None:
    """A glaive `<functioncall>` body -> a recorded call; None when its arguments are not JSON."""
    try:
        call = orjson.loads(text)
    except orjson.JSONDecodeError:
        call = None
    if not isinstance(call, dict):
        quoted = GLAIVE_QUOTED_CALL.match(text)
        if quoted is None:
            return None
        # Some arguments escape their apostrophes as \' inside the quotes, which JSON does not allow.
        call = {"name": quoted["name"], "arguments": quoted["arguments"].replace("\\'", "'")}
    try:
        return _call(call.get("name"), call.get("arguments"))
    except SkipRecord:
        return None


def parse_glaive(record: dict) -> Parsed:
    chat = record["chat"]
    system, tools = glaive_system(record.get("system") or "")
    messages = [{"role": "system", "content": system}] if system else []
    pieces = GLAIVE_MARKERS.split(chat)
    for marker, body in zip(pieces[1::2], pieces[2::2], strict=True):
        body = body.replace("<|endoftext|>", "").strip()
        message = {"role": GLAIVE_ROLES[marker], "content": body}
        if message["role"] == "assistant" and GLAIVE_CALL in body:
            content, _, call_text = body.partition(GLAIVE_CALL)
            call = glaive_call(call_text.strip())
            if call is None:
                return Parsed(messages, tools, cut="tool_call_unparsed")
            message = {"role": "assistant", "content": content.strip(), "tool_calls": [call]}
        messages.append(message)
    return Parsed(messages, tools)


PARSERS: dict[str, Callable[[dict], Parsed]] = {
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
            for call in message["tool_calls"]:
                calls.append(openai_call(call["name"], call["arguments"], index))
                index += 1
                if call.get("id"):
                    by_source_id[call["id"]] = calls[-1]
            open_calls.extend(calls)
            linked.append({"role": "assistant", "content": message["content"], "tool_calls": calls})
        elif message["role"] == "tool":
            call = by_source_id.get(message.get("tool_call_id")) or next(
                (c for c in open_calls if message.get("name") in (None, c["function"]["name"])), None
            )
            if call not in open_calls:
                return linked, "tool_result_unmatched"
            open_calls.remove(call)
            name = call["function"]["name"]
            linked.append({"role": "tool", "tool_call_id": call["id"], "name": name, "content": message["content"]})
        else:
            linked.append(message)
    return linked, None


def recorded_conversations(source: str | Path, fmt: str) -> Iterator[tuple[int, list[dict]]]:
    """(line, whole conversation) per record, assistant turns included and calls linked as prompts'
    are: what the demo models are fitted to answer."""
    for line_no, record in iter_records(source):
        parsed = PARSERS[detect_format(record) if fmt == "auto" else fmt](record)
        messages, _ = link_tool_calls(parsed.messages)
        yield line_no, messages


def prompt_messages(messages: list[dict], system_prompt: str | None) -> list[dict]:
    """Keep system and user turns, and recorded tool calls with their results; add a default system prompt.

    Plain assistant turns are dropped: the target model regenerates them.
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


def conversation_id(messages: Sequence[dict], tools: Sequence[dict] | None = None) -> str:
    """Stable content id: equal prompts get equal ids, which is also how duplicates are found.

    A prompt with tools or recorded calls hashes them too; one without keeps its earlier id.
    """
    if tools or any(m["role"] == "tool" or m.get("tool_calls") for m in messages):
        canonical = orjson.dumps({"tools": tools or [], "messages": messages}, option=orjson.OPT_SORT_KEYS)
    else:
        canonical = orjson.dumps([[m["role"], m["content"]] for m in messages])
    return hashlib.sha256(canonical).hexdigest()[:24]


def normalize(source: str | Path, fmt: str, system_prompt: str | None, stats: Counter) -> Iterator[dict]:
    """Yield normalized prompts from `source` in source order, counting what is skipped or cut."""
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
            parsed = PARSERS[record_format](record)
            messages, unmatched = link_tool_calls(parsed.messages)
            messages = prompt_messages(messages, system_prompt)
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
        for cut in filter(None, (parsed.cut, unmatched)):
            stats[f"cut_{cut}"] += 1
        source_info = {"file": str(source), "line": line_no, "format": record_format}
        if record.get("id") is not None:
            source_info["id"] = str(record["id"])
        prompt = {"id": conversation_id(messages, parsed.tools), "messages": messages, "source": source_info}
        if parsed.tools:
            prompt["tools"] = parsed.tools
        yield prompt
