"""What every layout's parser shares: the registry of dataset layouts (`LAYOUTS`: a parser registers
itself with `@layout`), the parsed conversation, the reasons a record yields no prompt, and the readers of
tool definitions and recorded calls that arrive as JSON text or as Python literals."""

from __future__ import annotations

import ast
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import orjson

from eagle3_datagen.chat.tool_calls import openai_tool
from eagle3_datagen.registry import Registry


class SkipRecord(Exception):
    """A record that is valid input but yields no prompt; the reason is counted."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class BadRecord(Exception):
    """A record that is not of the layout it was read as; counted with its line and reason."""


@dataclass
class Parsed:
    """A record's conversation in OpenAI layout (calls with their source ids, not yet Kimi's).

    `notes` counts what the parser did to the record that the partition's stats report:
    tool lists moved out of a system prompt, empty system turns dropped, fields it did not read.
    """

    messages: list[dict]
    tools: list[dict] | None = None
    cut: str | None = None  # why the conversation ends before the record's does (counted)
    notes: Counter = field(default_factory=Counter)


def text(content) -> str:
    """OpenAI content may be a string or a list of typed parts; keep the text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    raise SkipRecord("unsupported_content")


def literal(value: str, reason: str):
    """JSON text, else a Python literal (Hermes writes dicts with single quotes and `True`).

    `ast.literal_eval` reads literals only: nothing in the record is executed.
    """
    try:
        return orjson.loads(value)
    except orjson.JSONDecodeError:
        pass
    try:
        return ast.literal_eval(value.strip())
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        raise SkipRecord(reason) from None


def json_value(value, reason: str = "tool_json_unparsed"):
    """A value that may arrive JSON-encoded as a string (ShareGPT tools, OpenAI arguments)."""
    if isinstance(value, str):
        try:
            return orjson.loads(value)
        except orjson.JSONDecodeError:
            raise SkipRecord(reason) from None
    return value


def tools(value) -> list[dict] | None:
    """Function definitions (a list, or one as JSON text; bare or OpenAI-wrapped) in OpenAI layout."""
    definitions = json_value(value) if value else None
    if not definitions:
        return None
    if isinstance(definitions, dict):
        definitions = [definitions]
    try:
        return [openai_tool(d) for d in definitions]
    except (ValueError, TypeError, AttributeError):
        raise SkipRecord("tool_definition_unparsed") from None


def call(name, arguments, source_id=None) -> dict:
    """A recorded call, its arguments as compact JSON text.

    Raises SkipRecord when its name or arguments cannot be read; the parsers then cut the
    conversation before that turn (`cut_tool_call_unparsed`).
    """
    if not isinstance(name, str) or not name:
        raise SkipRecord("tool_call_unparsed")
    arguments = json_value(arguments if arguments is not None else {}, "tool_call_unparsed")
    return {"id": source_id, "name": name, "arguments": orjson.dumps(arguments).decode()}


def count_ignored(record: dict, used: frozenset[str], notes: Counter, prefix: str = "ignored_field") -> None:
    """Count the keys the parser does not read, so the partition's stats name every field left out."""
    for key in record:
        if key not in used:
            notes[f"{prefix}:{key}"] += 1


@dataclass(frozen=True)
class Layout:
    """A dataset layout (a partition's `format`): the parser of its records and what a record needs,
    quoted when one is not of it."""

    name: str
    parse: Callable[[dict], Parsed]
    needs: str


# Every dataset layout, in the order their modules register them; the schema's `format` enum is these and `auto`.
LAYOUTS: Registry[Layout] = Registry("dataset layout")


def layout(name: str, needs: str) -> Callable[[Callable[[dict], Parsed]], Callable[[dict], Parsed]]:
    """Registers the decorated parser as the layout `name`, whose records need `needs`."""

    def register(parse: Callable[[dict], Parsed]) -> Callable[[dict], Parsed]:
        LAYOUTS.register(name)(Layout(name, parse, needs))
        return parse

    return register
