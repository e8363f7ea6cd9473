"""Function-calling layouts whose tools, calls and results are written inside text: glaive's
`<functioncall>`, Hermes' `<tools>` / `<tool_call>` / `<tool_response>` tags, ToolACE's system
function list and `[Func(a=...)]` calls, and xLAM's `query` / `tools` / `answers` columns."""

from __future__ import annotations

import ast
import json
import re

import orjson

from eagle3_datagen.formats.datasets import common
from eagle3_datagen.formats.datasets.common import Parsed, SkipRecord, call, count_ignored, json_value, literal, tools

GLAIVE_MARKERS = re.compile(r"(USER:|ASSISTANT:|FUNCTION RESPONSE:)")
GLAIVE_ROLES = {"USER:": "user", "ASSISTANT:": "assistant", "FUNCTION RESPONSE:": "tool"}
GLAIVE_CALL = "<functioncall>"
GLAIVE_FIELDS = frozenset({"system", "chat", "id"})

# glaive writes a call's arguments as a single-quoted JSON string: {"name": "f", "arguments": '{"a": 1}'}
GLAIVE_QUOTED_CALL = re.compile(
    r"""^\{\s*"name"\s*:\s*"(?P<name>[^"]+)"\s*,\s*"arguments"\s*:\s*'(?P<arguments>.*)'\s*\}$""", re.S
)

# Hermes function calling (NousResearch/hermes-function-calling-v1's card, and the format its system
# prompts state: "function signatures within <tools> </tools> XML tags", calls "within <tool_call>
# </tool_call> tags" as {'arguments': <args-dict>, 'name': <function-name>}; NousResearch/
# Hermes-Function-Calling's README shows the calls as Python-literal dicts, single-quoted).
HERMES_TOOLS = re.compile(r"<tools>(?P<body>.*?)</tools>", re.S)
HERMES_CALL = re.compile(r"<tool_call>(?P<body>.*?)</tool_call>", re.S)
HERMES_RESPONSE = re.compile(r"<tool_response>(?P<body>.*?)</tool_response>", re.S)

# ToolACE (Team-ACE/ToolACE data.json rows: `system` + `conversations` from user/assistant/tool): the
# system prompt lists the functions as a JSON array after this sentence and asks for calls "in the
# format of [func1(params_name=params_value, params_name2=params_value2...), func2(params)]" (the
# mariem123kfg/sob-ft-toolace card, mapping it: "Format: system + conversations[]", "Tool calls:
# Bracket syntax [Func(a=1)]", "Tool schemas: Embedded in system prompt"); tool turns are JSON lists of
# {"name", "results"}.
TOOLACE_LIST = "Here is a list of functions in JSON format that you can invoke:\n"

# xLAM (Salesforce/xlam-function-calling-60k, and argilla/apigen-function-calling, which adds
# func_name/func_desc/hash_id/model_name/origin): `query`, `tools` and `answers` as JSON strings; read
# as NVIDIA-NeMo/Automodel's loader reads them (nemo_automodel/components/datasets/llm/xlam.py: the
# query is the user turn, the answers the assistant turn's tool_calls, a parameter without `default`
# is required).
XLAM_FIELDS = frozenset({"query", "tools", "answers", "id"})


def glaive_system(system: str) -> tuple[str, list[dict] | None]:
    """glaive's system prompt -> its prose and the function definitions (JSON objects) after it.

    `SYSTEM:` and the whitespace around the prose are glaive's markup, not its text.
    """
    prose = system.strip().removeprefix("SYSTEM:").strip()
    start = prose.find("{")
    if start < 0:
        return prose, None
    decoder, definitions, at = json.JSONDecoder(), [], start
    try:
        while at < len(prose):
            definition, at = decoder.raw_decode(prose, at)
            definitions.append(definition)
            at = len(prose) - len(prose[at:].lstrip())
    except json.JSONDecodeError:
        raise SkipRecord("tool_definition_unparsed") from None
    # The prose introduces the list ("... Use them if required -"); the template declares the tools.
    return prose[:start].rstrip().removesuffix("-").rstrip(), tools(definitions)


def glaive_call(body: str) -> dict | None:
    """A glaive `<functioncall>` body -> a recorded call; None when its arguments are not JSON."""
    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError:
        parsed = None
    if not isinstance(parsed, dict):
        quoted = GLAIVE_QUOTED_CALL.match(body)
        if quoted is None:
            return None
        # Some arguments escape their apostrophes as \' inside the quotes, which JSON does not allow.
        parsed = {"name": quoted["name"], "arguments": quoted["arguments"].replace("\\'", "'")}
    try:
        return call(parsed.get("name"), parsed.get("arguments"))
    except SkipRecord:
        return None


@common.layout("glaive", "chat (a string)")
def parse_glaive(record: dict) -> Parsed:
    """glaiveai/glaive-function-calling-v2: a `system` string (prose + JSON functions) and a `chat`
    string of `USER:` / `ASSISTANT:` / `FUNCTION RESPONSE:` turns, calls as `<functioncall> {...}`."""
    chat = record["chat"]
    if not isinstance(chat, str):
        raise TypeError("chat is not a string")
    system, declared = glaive_system(record.get("system") or "")
    parsed = Parsed([{"role": "system", "content": system}] if system else [], declared)
    count_ignored(record, GLAIVE_FIELDS, parsed.notes)
    if declared:
        parsed.notes["system_tool_list_moved_to_tools"] += 1
    pieces = GLAIVE_MARKERS.split(chat)
    for marker, body in zip(pieces[1::2], pieces[2::2], strict=True):
        body = body.replace("<|endoftext|>", "").strip()  # the turn separators are markup
        message = {"role": GLAIVE_ROLES[marker], "content": body}
        if message["role"] == "assistant" and GLAIVE_CALL in body:
            content, _, call_text = body.partition(GLAIVE_CALL)
            recorded = glaive_call(call_text.strip())
            if recorded is None:
                parsed.cut = "tool_call_unparsed"
                return parsed
            message = {"role": "assistant", "content": content.strip(), "tool_calls": [recorded]}
        parsed.messages.append(message)
    return parsed


def hermes_system(system: str) -> tuple[str, list[dict] | None]:
    """A system prompt with a `<tools>[...]</tools>` block -> the prose without the block, and the tools."""
    # The prose names the tags too ("within <tools> </tools> XML tags"): the block is the one with a body.
    block = next((m for m in HERMES_TOOLS.finditer(system) if m["body"].strip()), None)
    if block is None:
        return system, None
    definitions = literal(block["body"], "tool_definition_unparsed")
    prose = system[: block.start()].removesuffix("\n") + system[block.end() :]
    return prose, tools(definitions)


def hermes_calls(value: str) -> tuple[str, list[dict]]:
    """An assistant turn's `<tool_call>` bodies -> recorded calls; the text outside them is the content."""
    calls = []
    for match in HERMES_CALL.finditer(value):
        body = literal(match["body"], "tool_call_unparsed")
        if not isinstance(body, dict):
            raise SkipRecord("tool_call_unparsed")
        calls.append(call(body.get("name"), body.get("arguments")))
    return HERMES_CALL.sub("", value).strip("\n"), calls


def hermes_results(value: str) -> list[dict] | None:
    """A tool turn's `<tool_response>` blocks -> one result each, named by the function it gives;
    None when the turn has no such block (a plain result)."""
    blocks = [m["body"].removeprefix("\n").removesuffix("\n") for m in HERMES_RESPONSE.finditer(value)]
    if not blocks:
        return None
    results = []
    for body in blocks:
        try:
            name = literal(body, "tool_result_unparsed").get("name")
        except (SkipRecord, AttributeError):
            name = None
        results.append({"role": "tool", "content": body, **({"name": name} if isinstance(name, str) else {})})
    return results


def toolace_system(system: str) -> tuple[str, list[dict] | None]:
    """ToolACE's system prompt -> the prose without its function list, and the functions."""
    at = system.find(TOOLACE_LIST)
    if at < 0:
        return system, None
    start = at + len(TOOLACE_LIST)
    try:
        definitions, end = json.JSONDecoder().raw_decode(system, start)
    except json.JSONDecodeError:
        raise SkipRecord("tool_definition_unparsed") from None
    return system[:start] + system[end:], tools(definitions)


def _closing_paren(text: str, start: int) -> int:
    """The index of the `)` that closes the `(` at `start`, skipping quoted strings."""
    depth, quote, at = 0, None, start
    while at < len(text):
        char = text[at]
        if quote:
            if char == "\\":
                at += 1
            elif char == quote:
                quote = None
        elif char in "'\"":
            quote = char
        elif char in "([{":
            depth += 1
        elif char in ")]}":
            depth -= 1
            if depth == 0:
                return at
        at += 1
    raise SkipRecord("tool_call_unparsed")


def toolace_calls(value: str) -> list[dict] | None:
    """`[Name(a=1, b="x"), Other()]` -> recorded calls; None when the turn is not a call list.

    ToolACE's function names may hold spaces ("Get Manager Placeholder Image"), so the name is read
    up to its `(` and only the arguments are parsed, as Python keyword arguments of literals.
    """
    body = value.strip()
    if not (body.startswith("[") and body.endswith("]")):
        return None
    inner, calls, at = body[1:-1], [], 0
    while at < len(inner):
        paren = inner.find("(", at)
        name = inner[at:paren].strip() if paren >= 0 else ""
        if not name or any(c in name for c in "[]{}\"'=,"):
            return None if not calls else _unparsed()
        end = _closing_paren(inner, paren)
        try:
            node = ast.parse(f"f({inner[paren + 1 : end]})", mode="eval").body
            if not isinstance(node, ast.Call) or node.args:
                raise ValueError("positional arguments")
            arguments = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
        except (SyntaxError, ValueError, TypeError):
            return None if not calls else _unparsed()
        calls.append(call(name, arguments))
        at = end + 1
        rest = inner[at:].lstrip()
        if rest and not rest.startswith(","):
            return _unparsed()
        at = len(inner) - len(rest) + (1 if rest else 0)
    return calls or None


def _unparsed():
    raise SkipRecord("tool_call_unparsed")


def toolace_results(value: str) -> list[dict] | None:
    """A tool turn `[{"name": ..., "results": ...}, ...]` -> one result per entry, named."""
    try:
        entries = orjson.loads(value)
    except orjson.JSONDecodeError:
        return None
    named = isinstance(entries, list) and all(isinstance(e, dict) and isinstance(e.get("name"), str) for e in entries)
    if not named:
        return None
    return [{"role": "tool", "name": e["name"], "content": json.dumps(e, ensure_ascii=False)} for e in entries]


def xlam_tool(definition: dict) -> dict:
    """An xLAM function (parameters as {name: {type, description, default}}) in OpenAI layout; the
    parameters' own entries are kept as written (types such as "List[int]" have no JSON-schema name)."""
    parameters = definition.get("parameters") or {}
    if not isinstance(parameters, dict) or not isinstance(definition.get("name"), str):
        raise SkipRecord("tool_definition_unparsed")
    required = [name for name, spec in parameters.items() if not (isinstance(spec, dict) and "default" in spec)]
    schema = {"type": "object", "properties": parameters, **({"required": required} if required else {})}
    function = {"name": definition["name"], "description": definition.get("description", ""), "parameters": schema}
    return {"type": "function", "function": function}


@common.layout("xlam", "query, tools and answers")
def parse_xlam(record: dict) -> Parsed:
    """xLAM / APIGen: the query is the user turn, the recorded answers the first assistant turn's calls."""
    query = record["query"]
    if not isinstance(query, str):
        raise TypeError("query is not a string")
    definitions = json_value(record.get("tools") or [], "tool_definition_unparsed")
    answers = json_value(record.get("answers") or [], "tool_call_unparsed")
    if not isinstance(definitions, list) or not isinstance(answers, list):
        raise SkipRecord("tool_definition_unparsed")
    parsed = Parsed([{"role": "user", "content": query}], [xlam_tool(d) for d in definitions] or None)
    count_ignored(record, XLAM_FIELDS, parsed.notes)
    try:
        calls = [call(a.get("name"), a.get("arguments")) for a in answers]
    except (SkipRecord, AttributeError):
        parsed.cut = "tool_call_unparsed"
        return parsed
    if calls:
        parsed.messages.append({"role": "assistant", "content": "", "tool_calls": calls})
    return parsed
