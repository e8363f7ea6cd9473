"""Quality gates: which response rows the tokens stage does not train, and why.

Each gate looks at the assistant turns of one row as the responses stage wrote it
(`stages/responses/conversation.py`, `backends/base.Turn.as_message`) and names what is wrong:

- `truncated`: the conversation stopped at a turn cut off by `max_new_tokens` (`status: truncated`);
- `empty`: a turn with neither content nor tool calls;
- `content_filter`: a turn the provider stopped with `finish_reason: content_filter` (the raw reason
  the backend recorded in `produced_by.finish_reason`: OpenRouter's string, SGLang's `{"type": ...}`);
- `refusal`: a turn that carries the provider's `refusal` text;
- `repetition`: a turn whose reasoning or content ends in a loop: rep-n (Welleck et al. 2019,
  "Neural Text Degeneration with Unlikelihood Training": the share of the n-grams that repeat an
  earlier one, 1 - unique / all) over the last `window` words, above `max_rate`;
- `reasoning_leak`: the model's think markers written as text in a turn's content or reasoning
  (the template writes them itself, so rebuilt tokens would hold a second think block);
- `tool_call_syntax`: a call whose arguments are not a JSON object, or the template's tool-call
  markers left as text in a turn's content (a call its parser could not read).

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

GATES = ("truncated", "empty", "content_filter", "refusal", "repetition", "reasoning_leak", "tool_call_syntax")
# Rows that no setting trains: no answer, or one the template cannot render back.
UNUSABLE = ("failed", "malformed")

# Words: runs of letters and digits; each CJK ideograph, kana or hangul syllable is a word of its own
# (those scripts put no spaces between words). Punctuation is left out: JSON, tables and code repeat
# it in healthy answers.
_CJK = "\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\uac00-\ud7af"
_WORDS = re.compile(rf"[{_CJK}]|[^\W{_CJK}]+")
_CHARS_PER_WORD = 16  # a tail this many characters per word almost always holds `window` words


def repetition_rate(text: str, n: int, window: int) -> tuple[float, int]:
    """rep-n of `text`'s last `window` words: the share of its n-grams that repeat an earlier one, and
    how many n-grams there are. A loop fills the end of what it cuts short, hence the tail."""
    # Only the tail is read: a slice that holds more than `window` words (its first, perhaps cut, left
    # out), else the whole text; so a long answer costs what a short one does.
    words = _WORDS.findall(text[-window * _CHARS_PER_WORD :])
    if len(words) <= window and len(text) > window * _CHARS_PER_WORD:
        words = _WORDS.findall(text)
    words = words[-window:]
    grams = [tuple(words[i : i + n]) for i in range(len(words) - n + 1)]
    if not grams:
        return 0.0, 0
    return 1.0 - len(set(grams)) / len(grams), len(grams)


@dataclass(frozen=True)
class Repetition:
    enabled: bool
    n: int
    window: int
    min_ngrams: int
    max_rate: float

    def rate(self, text: str) -> float | None:
        """rep-n of `text`'s tail, or None when the tail is too short to judge."""
        rate, grams = repetition_rate(text, self.n, self.window)
        return rate if grams >= self.min_ngrams else None


@dataclass(frozen=True)
class GateSettings:
    """`tokens.gates` (config.schema.yaml says each one's meaning and default)."""

    truncated: bool
    empty: bool
    content_filter: bool
    refusal: bool
    repetition: Repetition
    reasoning_leak: bool
    tool_call_syntax: bool

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

    @classmethod
    def of(cls, tokenizer, specials, template_kwargs: dict | None = None) -> GateMarkers:
        """Read from the tokenizer and its chat template (`chat.template.SpecialTokens`, and the added
        tokens the template writes around a tool call), never from a table of one model's tokens."""
        from eagle3_datagen.chat.tool_calls import tool_call_marker_tokens

        think = tuple(t for t in (specials.think_start, specials.think_end) if t)
        return cls(think, tool_call_marker_tokens(tokenizer, template_kwargs))


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


class Gates:
    """The gates `settings` turns on, with the model's `markers`."""

    def __init__(self, settings: GateSettings, markers: GateMarkers):
        self.settings = settings
        self.markers = markers
        self.on = set(settings.enabled())

    def repetition(self, row: dict) -> float | None:
        """The highest rep-n over the row's turns' reasoning and content, or None when none is long enough."""
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
        for turn in turns:
            content = turn.get("content") or ""
            if not content.strip() and not turn.get("tool_calls"):
                found.add("empty")
            if raw_finish_reason(turn) == "content_filter":
                found.add("content_filter")
            if turn.get("refusal"):
                found.add("refusal")
            texts = (content, turn.get("reasoning") or "")
            if any(marker in text for marker in self.markers.think for text in texts):
                found.add("reasoning_leak")
            calls_bad = not all(_arguments_parse(call) for call in turn.get("tool_calls") or ())
            if calls_bad or any(marker in content for marker in self.markers.tool_calls):
                found.add("tool_call_syntax")
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
    repetition: Counter = field(default_factory=Counter)  # rows by their rep-n, in bins of 0.1

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
