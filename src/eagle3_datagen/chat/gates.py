"""Quality gates: which response rows the tokens stage does not train, and why.

Each gate looks at the assistant turns of one row as the responses stage wrote it
(`stages/responses/conversation.py`, `backends/base.Turn.as_message`) and names what is wrong:

- `truncated`: the conversation stopped at a turn cut off by `max_new_tokens` (`status: truncated`);
- `empty`: a turn with neither content nor tool calls;
- `content_filter`: a turn the provider stopped with `finish_reason: content_filter` (the raw reason
  the backend recorded in `produced_by.finish_reason`: OpenRouter's string, SGLang's `{"type": ...}`);
- `refusal`: a turn that carries the provider's `refusal` text, or whose content is a refusal and no
  more ("I'm sorry, but I can't help with that." and its kin, `is_refusal`);
- `repetition`: a turn whose reasoning or content ends in a loop: the same words written again and
  again, word for word (`loop_share`: the longest run of the last `window` words that repeats the
  words `period` before it, for any period up to `max_period`), filling more than `max_rate` of them.
  Structured text (60 SQL inserts, 30 Kubernetes services) repeats its keys with new values on every
  line, which breaks each run: it is not a loop;
- `reasoning_leak`: the model's think markers written as text in a turn's content or reasoning
  (the template writes them itself, so rebuilt tokens would hold a second think block); a marker
  quoted as code (in backticks or a fenced block, an answer about parsing think tags) is not one;
- `reasoning_missing`: a turn answered without reasoning by a model whose template says it reasons
  (`GateMarkers.thinking`); the `dataset` backend's rows (the records' own answers) and turns answering a
  tool's result (DeepSeek-V3.1's template opens no think block there) are not judged;
- `reasoning_in_content`: a turn whose content opens with the reasoning the provider should have
  split off ("The user is asking ...", "Okay, so the user said ...", `REASONING_OPENING`);
- `tool_call_syntax`: a call whose arguments are not a JSON object, or the template's tool-call
  markers left as text in a turn's content (a call its parser could not read);
- `tool_call_as_text`: where the request offered tools, a turn whose content writes a call to one of
  them as JSON (`{"name": ..., "arguments": ...}`, as Llama, Hermes and Glaive format a call) instead
  of calling it.

A gate that drops more than its share of a shard's rows (`tokens.gates.max_shard_rates`) fails the
shard's tokens job (`over_limits`): a provider that leaks reasoning or loops on a third of
the prompts is a run to fix, not data to thin out.

A failed row (`status: failed`, no answer) and a malformed one (output the template cannot render
back) are never trained; they are listed with the gates' drops, under `failed` and `malformed`.

The gates run in the tokens stage, not the responses stage: a changed gate setting then reruns the
tokens and what follows, never a paid request, and the markers come from the model's own tokenizer
and template, which the tokens stage loads anyway (`GateMarkers.of`). The module is a shared piece
beside the template and tool-call markup, since the report and the live status count with it too.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from itertools import pairwise

GATES = (
    "truncated",
    "empty",
    "content_filter",
    "refusal",
    "repetition",
    "reasoning_leak",
    "reasoning_missing",
    "reasoning_in_content",
    "tool_call_syntax",
    "tool_call_as_text",
)
# Rows that no setting trains: no answer, or one the template cannot render back.
UNUSABLE = ("failed", "malformed")

# Words: runs of letters and digits; each CJK ideograph, kana or hangul syllable is a word of its own
# (those scripts put no spaces between words). Punctuation is left out: JSON, tables and code repeat
# it in healthy answers.
_CJK = "\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\uac00-\ud7af"
_WORDS = re.compile(rf"[{_CJK}]|[^\W{_CJK}]+")
_CHARS_PER_WORD = 16  # a tail this many characters per word almost always holds the words asked for


def loop_share(text: str, window: int, max_period: int) -> tuple[float, int]:
    """The share of `text`'s last `window` words that a loop fills, and how many words were judged.

    A loop writes the same words again, word for word: over the tail, the longest run of words each
    equal to the word `period` before it, for the period (up to `max_period` words) that makes it
    longest, over the words judged. The candidate periods are the distances at which the tail's word
    pairs recur (a loop's period is the commonest). Structured text repeats its keys with new values
    (an id, a name) on every line, and each new value ends a run: SQL inserts or a list of services
    score the length of one line's constant part, a loop all of the window.
    """
    # Only the tail is read, with `max_period` words before it to compare against: a long answer
    # costs what a short one does.
    reach = window + max_period
    words = _WORDS.findall(text[-reach * _CHARS_PER_WORD :])
    if len(words) <= reach and len(text) > reach * _CHARS_PER_WORD:
        words = _WORDS.findall(text)
    words = words[-reach:]
    judged = min(window, len(words))
    start = len(words) - judged
    seen: dict[tuple[str, str], int] = {}
    distances: Counter = Counter()
    for i, pair in enumerate(pairwise(words)):
        if i >= start and pair in seen and i - seen[pair] <= max_period:
            distances[i - seen[pair]] += 1
        seen[pair] = i
    longest = 0
    for period, _ in distances.most_common(4):
        run = 0
        for i in range(max(start, period), len(words)):
            if words[i] == words[i - period]:
                run += 1
            else:
                longest, run = max(longest, run), 0
        longest = max(longest, run)
    return (longest / judged if judged else 0.0), judged


@dataclass(frozen=True)
class Repetition:
    enabled: bool
    window: int
    max_period: int
    min_words: int
    max_rate: float

    def rate(self, text: str) -> float | None:
        """The share of `text`'s tail a loop fills, or None when the tail is too short to judge."""
        share, judged = loop_share(text, self.window, self.max_period)
        return share if judged >= self.min_words else None


@dataclass(frozen=True)
class GateSettings:
    """`tokens.gates` (config.schema.yaml says each one's meaning and default)."""

    truncated: bool
    empty: bool
    content_filter: bool
    refusal: bool
    repetition: Repetition
    reasoning_leak: bool
    reasoning_missing: bool
    reasoning_in_content: bool
    tool_call_syntax: bool
    tool_call_as_text: bool
    max_shard_rates: dict[str, float]
    min_rows_judged: int

    @classmethod
    def from_config(cls, section: dict) -> GateSettings:
        """From the validated config's `tokens.gates`, where validation filled every default."""
        return cls(**{**section, "repetition": Repetition(**section["repetition"])})

    def enabled(self) -> list[str]:
        return [g for g in GATES if (self.repetition.enabled if g == "repetition" else getattr(self, g))]


@dataclass(frozen=True)
class GateMarkers:
    """The model's own markers that must not appear as text in a turn."""

    think: tuple[str, ...] = ()  # think start and end, where the tokenizer has them
    tool_calls: tuple[str, ...] = ()  # the template's tool-call markers
    thinking: bool = False  # the model reasons before each answer (`thinking_on`)

    @classmethod
    def of(cls, tokenizer, specials, template_kwargs: dict | None = None) -> GateMarkers:
        """Read from the tokenizer and its chat template (`chat.template.SpecialTokens`, and the added
        tokens the template writes around a tool call), never from a table of one model's tokens."""
        from eagle3_datagen.chat.tool_calls import tool_call_marker_tokens

        think = tuple(t for t in (specials.think_start, specials.think_end) if t)
        thinking = thinking_on(tokenizer, specials, template_kwargs)
        return cls(think, tool_call_marker_tokens(tokenizer, template_kwargs), thinking)


def thinking_on(tokenizer, specials, template_kwargs: dict | None = None) -> bool:
    """Whether the model reasons before every answer: its generation prompt opens a think block
    (Kimi-K2.5, Qwen3-2507 Thinking, DeepSeek-V3.1 with `thinking`), or `template_kwargs` switch
    reasoning on by a family's switch (Qwen3's hybrid `enable_thinking: true`, gpt-oss's
    `reasoning_effort`). A hybrid template left to its default is not judged: its model may answer
    without reasoning."""
    from eagle3_datagen.chat.families.base import FAMILIES
    from eagle3_datagen.chat.template import render_text

    switches = {cls.thinking_switch for _, cls in FAMILIES.items()} - {None}
    if any((template_kwargs or {}).get(key) for key in switches):
        return True
    start, end = specials.think_start, specials.think_end
    if not (start and end):
        return False
    prompt = render_text(tokenizer, [{"role": "user", "content": "Hi"}], True, template_kwargs)
    return start in prompt and end not in prompt[prompt.rindex(start) :]


def raw_finish_reason(turn: dict) -> str | None:
    """The provider's own finish reason where the backend recorded it (OpenRouter: a string; SGLang:
    `{"type": ...}`), else the turn's normalized one."""
    raw = (turn.get("produced_by") or {}).get("finish_reason")
    if isinstance(raw, dict):
        raw = raw.get("type")
    return raw if isinstance(raw, str) else turn.get("finish_reason")


def _arguments_parse(call: dict) -> bool:
    function = call.get("function") or {}
    try:
        arguments = json.loads(function.get("arguments") or "")
    except (TypeError, ValueError):
        return False
    return isinstance(arguments, dict) and bool(function.get("name"))


# Code quoted in a turn: fenced blocks and inline spans, where a think tag is text about tags.
_CODE = re.compile(r"```.*?```|~~~.*?~~~|`[^`\n]+`", re.S)

# An answer that declines the request, as chat models word it (OpenAI's "I'm sorry, but I can't assist
# with that.", Llama 3.1's "I can't provide information or guidance on illegal or harmful activities.",
# Kimi's "I'm sorry, but I can't help with that request."), and says nothing more than that sentence
# and an offer of other help (`is_refusal`).
REFUSAL = re.compile(
    r"^\W*(?:(?:I'm|I am|I’m)\s+(?:sorry|afraid)|Sorry|I apologi[sz]e|Unfortunately)?[,.!]?\s*(?:but\s+)?"
    r"(?:I\s*(?:can't|can’t|cannot|can not|won't|won’t|will not|must decline"
    r"|am (?:not able|unable)|'m (?:not able|unable)|’m (?:not able|unable))\s+(?:to\s+)?"
    r"(?:(?:help|assist)(?:\s+you)?\s+with\s+(?:that|this|your request|the request)"
    r"|(?:comply with|fulfill|fulfil|complete|process)\s+(?:that|this|your|the)\s+request"
    r"|provide (?:information|guidance|assistance|help) (?:on|or|about|with)"
    r"|(?:help|assist)(?:\s+you)?\s*[.!]"
    r"|(?:provide|create|write|generate|do)\s+(?:that|this)\s*[.!])"
    r"|(?:抱歉|对不起)[，,]?\s*(?:但\s*)?我(?:无法|不能)(?:帮助|协助|提供|满足|回答))",
    re.I,
)
_SENTENCE_END = re.compile(r"[.!?。！？](?:\s|$)")
_OFFER_MAX_CHARS = 80  # "Can I help you with something else?"


def is_refusal(content: str) -> bool:
    """`content` is a refusal and no more: "I can't help with that." alone, or followed by an offer of
    other help; "I can't assist with that. My functions only create calendar events." explains a limit
    (Glaive's tool-use answers), and "I can't browse the web, but here is ..." helps: both are trained."""
    match = REFUSAL.match(content)
    if not match:
        return False
    end = _SENTENCE_END.search(content, match.end())
    rest = content[end.end() :].strip() if end else ""
    return not rest or (rest.endswith("?") and len(rest) <= _OFFER_MAX_CHARS)


# The first words of reasoning written as the answer: the model describing the user's message to itself
# ("The user is asking ...", "Okay, so the user said "hello"." from a DeepSeek-R1 served without its
# reasoning parser, "1.  The user asks for the product ..." from a DeepSeek-V4 one) or planning aloud
# after an interjection ("Okay, so I need to figure out ...", "Hmm, let me think ...").
REASONING_OPENING = re.compile(
    r"^\W*(?:\d+\.\s*)?"
    r"(?:(?:(?:okay|ok|alright|all right|hmm+|well|so)\b[\s,.!]*)*the user"
    r"(?:\s+(?:is asking|asks|asked (?:me|about|for|how|what|why|whether|if)|has asked|just asked|wants|said|says"
    r"|is saying|has said|just said|sent|has sent|just sent|is requesting|requests|requested|greets|greeted"
    r"|is greeting|would like|wrote|has written|mentioned|mentions|seems to|is looking for|has provided|has shared)"
    r"|(?:'s|’s)\s+(?:question|message|query|request))\b"
    r"|(?:okay|ok|alright|all right|hmm+|well)\b[\s,.!]+(?:so\s+)?(?:I need to|I have to|I should figure"
    r"|let me (?:think|figure|see|try to figure|work (?:this|it) out|recall))"
    r"|(?:好的|嗯)?[，,]?\s*用户(?:问|想|要|说|询问|希望|需要|提到|让我))",
    re.I,
)


def _tool_names(row: dict) -> set[str]:
    """The names of the tools the request offered (OpenAI layout, or a bare function)."""
    names = set()
    for tool in row.get("tools") or ():
        if isinstance(tool, dict):
            function = tool.get("function") if isinstance(tool.get("function"), dict) else tool
            if isinstance(function.get("name"), str):
                names.add(function["name"])
    return names


def _is_call(value, names: set[str]) -> bool:
    """`value` (decoded JSON) holds a call to one of `names`: a name with its arguments (`arguments`, or
    `parameters` as Llama writes them; not a tool's declaration, whose parameters are a JSON schema)."""
    if isinstance(value, list):
        return any(_is_call(v, names) for v in value)
    if not isinstance(value, dict):
        return False
    if isinstance(value.get("function"), dict) and _is_call(value["function"], names):
        return True
    arguments = value.get("arguments", value.get("parameters"))
    is_schema = isinstance(arguments, dict) and "properties" in arguments
    return value.get("name") in names and arguments is not None and not is_schema


# A call written out where its JSON does not parse (Glaive quotes the arguments: `"arguments": '{...}'`):
# a name followed by its arguments, not by a declaration's schema.
_CALL_SHAPE = re.compile(
    r'"name"\s*:\s*"([^"]+)"\s*,\s*"(?:arguments|parameters)"\s*:\s*(?!\{\s*"type"\s*:\s*"object")[\'"{]'
)


def tool_call_in_text(content: str, names: set[str]) -> bool:
    """`content` writes a call to one of the offered tools `names` as JSON (bare, fenced, or inside a
    family's text markup such as Glaive's `<functioncall>` or Hermes' `<tool_call>`)."""
    if not names or not any(name in content for name in names):
        return False
    if any(match[1] in names for match in _CALL_SHAPE.finditer(content)):
        return True
    decoder = json.JSONDecoder()
    for opening in re.finditer(r"[{\[]", content):
        try:
            value, _ = decoder.raw_decode(content, opening.start())
        except ValueError:
            continue
        if _is_call(value, names):
            return True
    return False


class Gates:
    """The gates `settings` turns on, with the model's `markers`."""

    def __init__(self, settings: GateSettings, markers: GateMarkers):
        self.settings = settings
        self.markers = markers
        self.on = set(settings.enabled())

    def repetition(self, row: dict) -> float | None:
        """The largest loop share over the row's turns' reasoning and content, or None when none is long
        enough to judge."""
        rates = [
            rate
            for turn in _turns(row)
            for text in (turn.get("reasoning"), turn.get("content"))
            if text and (rate := self.settings.repetition.rate(text)) is not None
        ]
        return max(rates, default=None)

    def reasons(self, row: dict, repetition: float | None = None) -> list[str]:
        """Why `row` is not trained, in `GATES` order then `UNUSABLE`'s; empty: it is trained.
        `repetition`: the row's rate when the caller has it (`Gates.repetition`)."""
        if row["status"] == "failed":
            return ["failed"]
        turns = _turns(row)
        found = set()
        if row["status"] == "truncated" or any(t.get("finish_reason") == "length" for t in turns):
            found.add("truncated")
        names = _tool_names(row) if "tool_call_as_text" in self.on else set()
        generated = row.get("backend") != "dataset"  # the records' own answers carry no reasoning
        # A turn answering a tool's result is not judged for missing reasoning: templates such as
        # DeepSeek-V3.1's open no think block there, and the model answers without one.
        messages = row["messages"]
        after_tool = {id(m) for prev, m in zip(messages, messages[1:], strict=False) if prev["role"] == "tool"}
        for turn in turns:
            content = turn.get("content") or ""
            reasoning = turn.get("reasoning") or ""
            calls = turn.get("tool_calls") or ()
            if not content.strip() and not calls:
                found.add("empty")
            if raw_finish_reason(turn) == "content_filter":
                found.add("content_filter")
            if turn.get("refusal") or is_refusal(content):
                found.add("refusal")
            texts = (_CODE.sub(" ", content), _CODE.sub(" ", reasoning))
            if any(marker in text for marker in self.markers.think for text in texts):
                found.add("reasoning_leak")
            # An answer with no reasoning (a call may come straight away; reasoning left in the content
            # before a think marker is a leak's).
            unsplit = any(marker in content for marker in self.markers.think)
            thought = reasoning.strip() or calls or unsplit
            if generated and self.markers.thinking and content.strip() and not thought and id(turn) not in after_tool:
                found.add("reasoning_missing")
            if not unsplit and REASONING_OPENING.match(content):
                found.add("reasoning_in_content")
            calls_bad = not all(_arguments_parse(call) for call in calls)
            if calls_bad or any(marker in content for marker in self.markers.tool_calls):
                found.add("tool_call_syntax")
            if names and tool_call_in_text(content, names):
                found.add("tool_call_as_text")
        if "repetition" in self.on:
            rate = self.repetition(row) if repetition is None else repetition
            if rate is not None and rate > self.settings.repetition.max_rate:
                found.add("repetition")
        reasons = [g for g in GATES if g in found and g in self.on]
        return [*reasons, "malformed"] if row["status"] == "malformed" else reasons


def _turns(row: dict) -> list[dict]:
    return [m for m in row["messages"] if m["role"] == "assistant"]


def _decile(rate: float) -> str:
    """`rate`'s bin of width 0.1 by its lower edge ("0.0" ... "0.9"; 1.0 falls in "0.9")."""
    return f"{min(int(rate * 10), 9) / 10:.1f}"


@dataclass
class GateTally:
    """What the gates did to one shard's rows (merged across the worker processes that share a shard)."""

    rows: int = 0
    counts: Counter = field(default_factory=Counter)  # rows each reason applies to (a row may have several)
    dropped: dict[str, list[str]] = field(default_factory=dict)  # row id -> its reasons
    repetition: Counter = field(default_factory=Counter)  # rows by their loop share, in bins of 0.1

    def check(self, gates: Gates, rows: Iterable[dict]) -> list[dict]:
        """The rows that pass `gates`; the others are counted and listed with their reasons."""
        kept = []
        for row in rows:
            rate = gates.repetition(row) if "repetition" in gates.on and row["status"] != "failed" else None
            reasons = gates.reasons(row, rate)
            self.rows += 1
            if rate is not None:
                self.repetition[_decile(rate)] += 1
            if reasons:
                self.counts.update(reasons)
                self.dropped[row["id"]] = reasons
            else:
                kept.append(row)
        return kept

    def merge(self, other: GateTally) -> None:
        self.rows += other.rows
        self.counts.update(other.counts)
        self.dropped.update(other.dropped)
        self.repetition.update(other.repetition)

    def report(self, settings: GateSettings) -> dict:
        """The shard's `gates` in its audit.json: each enabled gate's count and rate (a gate that is off
        is left out: `off` names it), and every dropped row's id with its reasons."""
        shown = [*settings.enabled(), *UNUSABLE]
        return {
            "rows": self.rows,
            "dropped_rows": len(self.dropped),
            "counts": {reason: self.counts[reason] for reason in shown},
            "rates": {reason: self.counts[reason] / self.rows if self.rows else 0.0 for reason in shown},
            "off": [g for g in GATES if g not in shown],
            "repetition_rates": dict(sorted(self.repetition.items())),
            "dropped": self.dropped,
        }


def over_limits(gates: dict, settings: GateSettings) -> list[tuple[str, int, float, float]]:
    """The enabled gates that dropped more than their `max_shard_rates` share of a shard's rows (`gates`:
    its `GateTally.report`), as (gate, count, rate, limit); none for a shard of fewer than
    `min_rows_judged` rows (too few to tell a rate)."""
    if gates["rows"] < settings.min_rows_judged:
        return []
    return [
        (gate, gates["counts"][gate], gates["rates"][gate], settings.max_shard_rates[gate])
        for gate in settings.enabled()
        if gates["rates"][gate] > settings.max_shard_rates[gate]
    ]


def console_line(name: str, gates: dict) -> str:
    """One line for the console: rows in, rows dropped, and each gate's count and rate."""
    rows = gates["rows"]
    kept = rows - gates["dropped_rows"]
    counts = gates["counts"]
    parts = [f"{r} {counts[r]} ({gates['rates'][r]:.1%})" for r in (*GATES, *UNUSABLE) if counts.get(r)]
    dropped = f"{gates['dropped_rows']} dropped ({gates['dropped_rows'] / rows:.1%})" if rows else "0 dropped"
    return f"gates: {name}: {rows} rows, {kept} trained, {dropped}" + (": " + ", ".join(parts) if parts else "")


def pooled(reports: Iterable[dict]) -> dict:
    """Several shards' `gates` reports as one (counts summed, rates over all their rows; no id list)."""
    reports = list(reports)
    rows = sum(r["rows"] for r in reports)
    dropped = sum(r["dropped_rows"] for r in reports)
    counts: Counter = Counter()
    repetition: Counter = Counter()
    for r in reports:
        counts.update(r["counts"])
        repetition.update(r.get("repetition_rates", {}))
    counted = {k for r in reports for k in r["counts"]}
    shown = [k for k in (*GATES, *UNUSABLE) if k in counted]
    return {
        "rows": rows,
        "dropped_rows": dropped,
        "counts": {k: counts[k] for k in shown},
        "rates": {k: counts[k] / rows if rows else 0.0 for k in shown},
        "off": sorted({g for r in reports for g in r.get("off", [])}),
        "repetition_rates": dict(sorted(repetition.items())),
    }
