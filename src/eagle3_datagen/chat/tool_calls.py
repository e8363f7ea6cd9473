"""Tool calls in OpenAI layout with Kimi's call ids, and the target model's own tool-call markers.

Calls are stored as `{"id": "functions.{name}:{index}", "type": "function", "function": {"name",
"arguments": <JSON string>}}`; the index counts the conversation's calls before it, as SGLang's
`kimi_k2` parser numbers them (`serving_chat._process_tool_call_id`). A model's raw output is split
into content and calls the way that parser's `KimiK2Detector.detect_and_parse` does, with the
markers read from the chat template (`derive_markers`), not from a table of token IDs.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from eagle3_datagen.chat.template import FamilyRendering

# A call id as the model writes it: "functions.get_time:0", or "get_time:0" (KimiK2Detector's pattern).
MODEL_CALL_ID = re.compile(r"^(?:functions\.)?(?P<name>[\w.\-]+):(?P<index>\d+)$")
BARE_COUNTER = re.compile(r"^\d+$")


def call_id(name: str, index: int) -> str:
    return f"functions.{name}:{index}"


def openai_call(name: str, arguments: str, index: int) -> dict:
    return {"id": call_id(name, index), "type": "function", "function": {"name": name, "arguments": arguments}}


def declared_call(call: dict, tools: Sequence[dict] | None, index: int) -> dict | None:
    """A parsed `{"name", "arguments" | "parameters"}` object as an OpenAI call numbered `index`, its
    arguments JSON as SGLang's parsers write them (`BaseFormatDetector.parse_base_json`); None for a
    function that `tools` does not declare (SGLang drops those)."""
    name = call.get("name")
    if not name or name not in {tool["function"]["name"] for tool in tools or ()}:
        return None
    arguments = call.get("parameters") or call.get("arguments", {})
    return openai_call(name, json.dumps(arguments, ensure_ascii=False), index)


def calls_before(messages: Sequence[dict]) -> int:
    """Tool calls in `messages`' assistant turns: the index the next call gets."""
    return sum(len(m.get("tool_calls") or ()) for m in messages if m["role"] == "assistant")


def same_call(regenerated: dict, recorded: dict) -> bool:
    """Same function, arguments equal as JSON values (key order and spacing do not matter).

    Arguments that are not JSON equal nothing.
    """
    a, b = regenerated["function"], recorded["function"]
    if a["name"] != b["name"]:
        return False
    try:
        return _json_equal(json.loads(a["arguments"]), json.loads(b["arguments"]))
    except (TypeError, ValueError):
        return False


def _json_equal(a, b) -> bool:
    """JSON value equality: 5 equals 5.0, but true is not 1 (as Python's == would have it)."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_json_equal(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(map(_json_equal, a, b))
    return a == b


def openai_tool(definition: dict) -> dict:
    """A function definition, bare or OpenAI-wrapped, in OpenAI's `tools` layout."""
    function = definition.get("function", definition) if definition.get("type", "function") == "function" else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ValueError(f"not a function definition: {json.dumps(definition)[:200]}")
    return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolCallMarkers:
    """The strings a template wraps tool calls in: Kimi's section, call and argument markers."""

    section_begin: str
    section_end: str
    call_begin: str
    argument_begin: str
    call_end: str

    def _call_pattern(self) -> re.Pattern:
        # KimiK2Detector.tool_call_regex with this template's markers.
        begin, argument, end = (re.escape(m) for m in (self.call_begin, self.argument_begin, self.call_end))
        return re.compile(
            rf"{begin}\s*(?P<id>[^\s<|]+)\s*{argument}\s*(?P<arguments>\{{.*?\}})\s*{end}",
            re.DOTALL,
        )

    def split(self, text: str, tools: Sequence[dict] | None, first_index: int) -> tuple[str, list[dict] | None]:
        """A turn's text -> (content, calls), as SGLang's kimi_k2 parser reads it.

        No section: all content, calls None. A section whose calls cannot be read: the text is
        returned as content with an empty call list (SGLang then keeps the raw text). Calls get
        Kimi ids numbered from `first_index`; the model's own `:N` is not used for them.
        """
        if self.section_begin not in text:
            return text, None
        calls = []
        for match in self._call_pattern().finditer(text):
            name = _call_name(match["id"], tools)
            if name is not None:
                calls.append(openai_call(name, match["arguments"], first_index + len(calls)))
        if not calls:
            return text, []
        return text[: text.find(self.section_begin)], calls

    def render(self, calls: Sequence[tuple[str, str]], first_index: int = 0) -> str:
        """The section a model emits for `(name, arguments)` calls, numbered from `first_index`."""
        return self.render_calls(
            [openai_call(name, arguments, first_index + i) for i, (name, arguments) in enumerate(calls)]
        )

    def render_calls(self, calls: Sequence[dict]) -> str:
        """The section a model emits for OpenAI-layout `calls`, with their ids as they are."""
        body = "".join(
            f"{self.call_begin}{call['id']}{self.argument_begin}{call['function']['arguments']}{self.call_end}"
            for call in calls
        )
        return f"{self.section_begin}{body}{self.section_end}"


def _call_name(model_id: str, tools: Sequence[dict] | None) -> str | None:
    """The function a model's call id names; a bare counter names the only declared tool."""
    match = MODEL_CALL_ID.match(model_id)
    if match:
        return match["name"]
    if BARE_COUNTER.match(model_id) and tools and len(tools) == 1:
        return tools[0]["function"]["name"]
    return None


def derive_markers(
    tokenizer: PreTrainedTokenizerBase, template_kwargs: dict | None = None, family: FamilyRendering | None = None
) -> ToolCallMarkers:
    """Read the tool-call markers off the chat template's rendering of a two-call turn.

    The template must write each call as `{call_begin}{id}{argument_begin}{arguments}{call_end}`
    inside `{section_begin}...{section_end}` (Kimi's layout); the markers are split at token
    boundaries, so they need not be special tokens.
    """
    # Imported here: the prompts stage uses this module's layout helpers without transformers.
    from eagle3_datagen.chat.template import PROBE_ASSISTANT, PROBE_USER, TemplateError, encode, render_text

    calls = [openai_call("probe_first", '{"x": 1}', 0), openai_call("probe_second", '{"y": 2}', 1)]
    user = {"role": "user", "content": PROBE_USER}
    turn = {"role": "assistant", "content": PROBE_ASSISTANT, "tool_calls": calls}
    try:
        text = render_text(tokenizer, [user, turn], False, template_kwargs, family=family)
    except Exception as e:  # a template may raise on tool calls (jinja's raise_exception)
        raise TemplateError(f"the chat template cannot render a tool call ({type(e).__name__}: {e})") from None
    text = text[text.rindex(PROBE_ASSISTANT) + len(PROBE_ASSISTANT) :]
    pieces, at = [], 0
    for call in calls:
        for part in (call["id"], call["function"]["arguments"]):
            found = text.find(part, at)
            if found < 0:
                raise TemplateError(
                    "the chat template does not write a tool call as its id followed by its arguments (Kimi's "
                    "layout: <|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{...}<|tool_call_end|>); "
                    "tool calls cannot be regenerated with this template"
                )
            pieces.append(text[at:found])
            at = found + len(part)
    opening, argument, between, _, closing = [encode(tokenizer, p) for p in (*pieces, text[at:])]
    call_begin = _common_suffix(opening, between)
    special = {i for i, added in tokenizer.added_tokens_decoder.items() if added.special}
    after_call_end = closing[len(between) - len(call_begin) :]
    section_end = after_call_end[: next((i for i, t in enumerate(after_call_end) if t in special), None)]
    markers = ToolCallMarkers(
        section_begin=tokenizer.decode(opening[: len(opening) - len(call_begin)]),
        section_end=tokenizer.decode(section_end),
        call_begin=tokenizer.decode(call_begin),
        argument_begin=tokenizer.decode(argument),
        call_end=tokenizer.decode(between[: len(between) - len(call_begin)]),
    )
    if not all(vars(markers).values()) or closing[: len(between) - len(call_begin)] != between[: -len(call_begin)]:
        raise TemplateError(f"the chat template's tool-call markers could not be told apart: {markers}")
    return markers


def _common_suffix(a: list[int], b: list[int]) -> list[int]:
    n = 0
    while n < min(len(a), len(b)) and a[-1 - n] == b[-1 - n]:
        n += 1
    return a[len(a) - n :]


def tool_call_marker_tokens(tokenizer: PreTrainedTokenizerBase, template_kwargs: dict | None = None) -> tuple[str, ...]:
    """The tokenizer's added tokens that the chat template writes around a tool call and nowhere in a
    plain answer: Kimi's section, call and argument markers, Qwen3's `<tool_call>` and `</tool_call>`,
    DeepSeek's `<｜tool▁calls▁begin｜>`..., gpt-oss's `<|call|>`. None for a template that writes calls
    without added tokens (Llama 3.1's JSON) or cannot render one (it raises on tool calls)."""
    from eagle3_datagen.chat.template import PROBE_ASSISTANT, PROBE_USER, render_text

    user = {"role": "user", "content": PROBE_USER}
    plain = {"role": "assistant", "content": PROBE_ASSISTANT}
    calling = {**plain, "tool_calls": [openai_call("probe_first", '{"x": 1}', 0)]}
    try:
        with_call = render_text(tokenizer, [user, calling], False, template_kwargs)
        without = render_text(tokenizer, [user, plain], False, template_kwargs)
    except Exception:  # a template may raise on tool calls (jinja's raise_exception)
        return ()
    added = {token.content for token in tokenizer.added_tokens_decoder.values()}
    return tuple(sorted(t for t in added if t in with_call and t not in without))
