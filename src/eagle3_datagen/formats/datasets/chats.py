"""Turn-list and single-exchange layouts: ShareGPT (with Hermes' and ToolACE's tool dialects), OpenAI
messages, Alpaca, and the problem/solution and query/answer columns of code datasets."""

from __future__ import annotations

from eagle3_datagen.formats.datasets import common, toolcalls
from eagle3_datagen.formats.datasets.common import Parsed, SkipRecord, call, count_ignored, json_value, text, tools

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

# The record keys and turn keys each parser reads; any other is counted as ignored.
SHAREGPT_FIELDS = frozenset({"conversations", "tools", "system", "id"})
SHAREGPT_TURN_FIELDS = frozenset({"from", "value"})
OPENAI_FIELDS = frozenset({"messages", "tools", "functions", "id"})
OPENAI_TURN_FIELDS = frozenset({"role", "content", "tool_calls", "function_call", "tool_call_id", "name"})
# Alpaca (LLaMA-Factory data/README.md: instruction, input, output, system, history as [query,
# response] pairs); Magicoder-Evol-Instruct-110K names the output `response`.
ALPACA_FIELDS = frozenset({"instruction", "input", "output", "response", "system", "history", "id"})
# Magicoder-OSS-Instruct-75K (ise-uiuc): lang, raw_index, index, seed, openai_fingerprint, problem,
# solution (the features its copies' cards list, e.g. fhai50032/magicoder-oss-instruct-sharegpt-75k and
# bobchenyx/C2Rust-Moxin's dataset_schema.md, translated: "seed: the seed code snippet used to generate the problem",
# "problem: natural-language problem", "solution: the solution code"). The problem is the user turn, the
# solution the answer; the seed is not a turn: counted as ignored like the rest.
PROBLEM_FIELDS = frozenset({"problem", "solution", "id"})
# m-a-p/CodeFeedback-Filtered-Instruction: query, answer, resource, lang (its card is empty; the row in
# tests/fixtures/realdata/PROVENANCE.md). glaiveai/glaive-code-assistant (its card: "structured in a QA
# format"; mwitiderrick/glaive-code-assistant's card renders it from `{question}` and `{answer}`).
QUERY_FIELDS = frozenset({"query", "question", "answer", "id"})


def _sharegpt_calls(value: str) -> list[dict]:
    """LLaMA-Factory's `function_call` turn: one call or a list, as JSON text."""
    calls = json_value(value, "tool_call_unparsed")
    calls = calls if isinstance(calls, list) else [calls]
    return [call(c.get("name"), c.get("arguments")) for c in calls]


def _openai_calls(message: dict) -> list[dict]:
    calls = [
        call(c["function"]["name"], c["function"].get("arguments"), c.get("id"))
        for c in message.get("tool_calls") or ()
    ]
    if message.get("function_call"):  # the legacy single call
        calls.append(call(message["function_call"]["name"], message["function_call"].get("arguments")))
    return calls


def _system_tools(system: str, dialect: str | None) -> tuple[str, list[dict] | None, str]:
    """A system prompt's embedded function list -> (prose, tools, dialect of the calls that follow)."""
    if dialect in (None, "hermes"):
        prose, declared = toolcalls.hermes_system(system)
        if declared:
            return prose, declared, "hermes"
    if dialect in (None, "toolace"):
        prose, declared = toolcalls.toolace_system(system)
        if declared:
            return prose, declared, "toolace"
    return system, None, dialect or "plain"


# A turn names its speaker and text as ShareGPT does ({from, value}) or as OpenAI does ({role, content});
# datasets of either layout use both (ShareGPT `conversations` of {role, content} are common on the hub),
# so each turn is read by its own keys, and the roles either layout names are known to both.
TURN_STYLES = {"from": ("from", "value", SHAREGPT_TURN_FIELDS), "role": ("role", "content", OPENAI_TURN_FIELDS)}
OTHER_STYLE = {"from": "role", "role": "from"}
ROLES = {**SHAREGPT_ROLES, **OPENAI_ROLES}


def _turn_style(turn: dict, own: str) -> tuple[str, str, frozenset[str]]:
    """The turn's (speaker key, text key, keys read): the layout's own, unless only the other's is there."""
    if own not in turn and OTHER_STYLE[own] in turn:
        return TURN_STYLES[OTHER_STYLE[own]]
    return TURN_STYLES[own]


def _turns(record: dict, list_key: str, own_style: str) -> Parsed:
    turns = record.get(list_key)
    if not isinstance(turns, list):
        raise KeyError(list_key)
    parsed = Parsed([])
    other_style = None
    for turn in turns:
        if not isinstance(turn, dict):
            raise TypeError(f"a turn of {list_key} is not an object")
        role_key, content_key, used_turn_keys = _turn_style(turn, own_style)
        if role_key != own_style:
            other_style = f"{list_key}_turns_read_as_{role_key}_{content_key}"
        count_ignored(turn, used_turn_keys, parsed.notes, "ignored_turn_field")
        source_role = str(turn.get(role_key, "")).lower()
        role = ROLES.get(source_role)
        if role is None:
            raise SkipRecord("unknown_role")
        message = {"role": role, "content": text(turn.get(content_key))}
        try:
            if source_role == "function_call":
                message.update(content="", tool_calls=_sharegpt_calls(turn.get(content_key)))
            elif role == "assistant" and (turn.get("tool_calls") or turn.get("function_call")):
                message["tool_calls"] = _openai_calls(turn)
        except (SkipRecord, KeyError, TypeError, AttributeError):
            parsed.cut = "tool_call_unparsed"
            return parsed
        if role == "tool":
            message.update({k: turn[k] for k in ("tool_call_id", "name") if turn.get(k)})
        parsed.messages.append(message)
    if other_style:
        parsed.notes[other_style] += 1  # records, so the stats show which turn layout was read
    return parsed


def _dialect_turns(parsed: Parsed, dialect: str) -> None:
    """Read Hermes' or ToolACE's calls and results out of the turns' text, in place."""
    messages = []
    for message in parsed.messages:
        try:
            if message["role"] == "assistant" and not message.get("tool_calls"):
                if dialect == "hermes" and "<tool_call>" in message["content"]:
                    content, calls = toolcalls.hermes_calls(message["content"])
                    message = {"role": "assistant", "content": content, "tool_calls": calls}
                elif dialect == "toolace" and (calls := toolcalls.toolace_calls(message["content"])):
                    message = {"role": "assistant", "content": "", "tool_calls": calls}
            elif message["role"] == "tool" and "tool_call_id" not in message:
                results = (toolcalls.hermes_results if dialect == "hermes" else toolcalls.toolace_results)(
                    message["content"]
                )
                if results:
                    messages.extend(results)
                    continue
        except SkipRecord as unreadable:
            parsed.messages, parsed.cut = messages, unreadable.reason
            return
        messages.append(message)
    parsed.messages = messages


@common.layout("sharegpt", "conversations (a list of {from, value})")
def parse_sharegpt(record: dict, dialect: str | None = None) -> Parsed:
    """ShareGPT `conversations` of {from, value} (or {role, content}), with LLaMA-Factory's `tools` and `system` columns
    (data/README.md: "system: the column name in the dataset containing the system prompts").

    A function list embedded in the system prompt (Hermes' `<tools>` block, ToolACE's JSON list) moves
    to `tools`, and the turns are then read in that dataset's call syntax. `dialect` forces one
    ("hermes", "toolace"; "plain" reads none); None detects it from the system prompt.
    """
    parsed = _turns(record, "conversations", "from")
    count_ignored(record, SHAREGPT_FIELDS, parsed.notes)
    system = record.get("system")
    if isinstance(system, str) and system.strip():
        parsed.messages.insert(0, {"role": "system", "content": system})
    declared = tools(record.get("tools"))
    if dialect != "plain" and parsed.messages and parsed.messages[0]["role"] == "system":
        prose, embedded, dialect = _system_tools(parsed.messages[0]["content"], dialect)
        if embedded:
            parsed.messages[0] = {"role": "system", "content": prose}
            parsed.notes["system_tool_list_moved_to_tools"] += 1
            declared = (declared or []) + embedded
    if dialect in ("hermes", "toolace"):
        _dialect_turns(parsed, dialect)
    parsed.tools = declared
    return parsed


@common.layout("hermes", "conversations (a list of {from, value})")
def parse_hermes(record: dict) -> Parsed:
    return parse_sharegpt(record, "hermes")


@common.layout("toolace", "conversations (a list of {from, value})")
def parse_toolace(record: dict) -> Parsed:
    return parse_sharegpt(record, "toolace")


@common.layout("openai", "messages (a list of {role, content})")
def parse_openai(record: dict) -> Parsed:
    parsed = _turns(record, "messages", "role")
    count_ignored(record, OPENAI_FIELDS, parsed.notes)
    parsed.tools = tools(record.get("tools") or record.get("functions"))
    return parsed


def _exchange(user, answer, fields: frozenset[str], record: dict, system=None) -> Parsed:
    if not isinstance(user, str):
        raise TypeError("the prompt column is not a string")
    messages = [{"role": "user", "content": user}, {"role": "assistant", "content": answer or ""}]
    if isinstance(system, str) and system:
        messages.insert(0, {"role": "system", "content": system})
    parsed = Parsed(messages)
    count_ignored(record, fields, parsed.notes)
    return parsed


@common.layout("alpaca", "instruction and output")
def parse_alpaca(record: dict) -> Parsed:
    instruction = record["instruction"]
    extra = record.get("input") or ""
    user = f"{instruction}\n\n{extra}" if extra.strip() else instruction
    answer = record.get("output") or record.get("response")
    parsed = _exchange(user, answer, ALPACA_FIELDS, record, record.get("system"))
    history = record.get("history") or []
    earlier = [
        {"role": role, "content": turn}
        for pair in history
        for role, turn in zip(("user", "assistant"), pair, strict=True)
    ]
    at = 1 if parsed.messages[0]["role"] == "system" else 0
    parsed.messages[at:at] = earlier
    return parsed


@common.layout("problem_solution", "problem and solution")
def parse_problem_solution(record: dict) -> Parsed:
    return _exchange(record["problem"], record.get("solution"), PROBLEM_FIELDS, record)


@common.layout("query_answer", "query or question, and answer")
def parse_query_answer(record: dict) -> Parsed:
    user = record["query"] if "query" in record else record["question"]
    return _exchange(user, record.get("answer"), QUERY_FIELDS, record)
