"""Stage 3: responses -> input_ids + loss mask, rebuilt with the model's own chat template.

Turn boundaries come from rendering, not from re-encoding text prefixes: the history
rendered alone must be a prefix of the whole conversation's rendering, a turn starts where
the history rendered with the generation prompt stops agreeing with it, and ends at the
end-of-turn token the template places after it. The loss covers the turn and its
end-of-turn token. Each sample's text is encoded once, whole; boundaries map to tokens
through the tokenizer's offsets.

Where the backend returned the exact generated IDs, they are audited against the IDs
rebuilt from text and, by default, the last turn is trained on exactly what the model saw
and produced: the generation prompt followed by those IDs.
"""

from __future__ import annotations

import bisect
import logging
import multiprocessing
import os
import re
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from transformers import PreTrainedTokenizerBase

from .chat import SpecialTokens, load_tokenizer, render_text, resolve_special_tokens
from .histograms import histogram
from .io import read_jsonl, write_json, write_jsonl_zst
from .progress import Progress

log = logging.getLogger(__name__)

THINKING_MODES = ("keep_last", "keep_all", "drop")


class BoundaryError(ValueError):
    """The chat template is not prefix-stable at an assistant turn's start."""


class ReasoningDroppedError(ValueError):
    """The template would drop the reasoning of the turn being trained."""


class AuditFailure(RuntimeError):
    """Too many semantic mismatches between rebuilt and server token IDs."""


@dataclass
class TokenSettings:
    thinking: str = "keep_last"
    prefer_ids: str = "server"  # "server" | "text"
    keep_truncated: bool = False
    max_length: int = 32768
    length_policy: str = "truncate"  # "truncate" | "drop"
    max_semantic_mismatch_rate: float = 0.01
    audit_examples: int = 5

    @classmethod
    def from_config(cls, section: dict) -> TokenSettings:
        return cls(**{k: v for k, v in section.items() if k in cls.__dataclass_fields__})


@dataclass
class Audit:
    """Counts for one shard, written as `{shard}.audit.json`."""

    counts: Counter = field(default_factory=Counter)
    comparisons: Counter = field(default_factory=Counter)
    examples: list = field(default_factory=list)

    def compare(
        self,
        sample_id: str,
        rendered: list[int],
        server: list[int],
        tokenizer: PreTrainedTokenizerBase,
        keep_examples: int,
    ) -> str:
        if rendered == server:
            kind = "exact"
        else:
            rendered_text = tokenizer.decode(rendered, skip_special_tokens=False)
            server_text = tokenizer.decode(server, skip_special_tokens=False)
            kind = "bpe_only" if rendered_text == server_text else "semantic"
            self._keep_example(
                {
                    "id": sample_id,
                    "kind": kind,
                    "rebuilt_ids": rendered[:64],
                    "server_ids": server[:64],
                    "rebuilt_text": rendered_text[:200],
                    "server_text": server_text[:200],
                },
                keep_examples,
            )
        self.comparisons[kind] += 1
        return kind

    def _keep_example(self, example: dict, keep_examples: int) -> None:
        if sum(1 for e in self.examples if e["kind"] == example["kind"]) < keep_examples:
            self.examples.append(example)

    def merge(self, other: Audit, keep_examples: int) -> None:
        self.counts.update(other.counts)
        self.comparisons.update(other.comparisons)
        for example in other.examples:
            self._keep_example(example, keep_examples)

    def summary(self) -> dict:
        compared = sum(self.comparisons.values())
        return {
            "turns_compared": compared,
            **{kind: self.comparisons[kind] for kind in ("exact", "bpe_only", "semantic")},
            "bpe_only_rate": self.comparisons["bpe_only"] / compared if compared else 0.0,
            "semantic_rate": self.comparisons["semantic"] / compared if compared else 0.0,
            "examples": self.examples,
        }


@dataclass
class _Plan:
    """One sample between rendering and encoding: its text and the character span of each turn."""

    sample_id: str
    text: str
    char_spans: list[tuple[int, int]]
    last_turn: dict
    prompt_text: str  # the last turn's generation prompt: what the model saw
    server_ids: list[int] | None  # the last turn's generated IDs, when they apply


class TokenBuilder:
    """Response rows -> training samples, a batch of rows at a time.

    Each sample is rendered to text, its turn boundaries found as character offsets in that
    text, the text encoded once, whole, and the offsets mapped to token positions through the
    fast tokenizer's offset mapping. `boundaries="prefix"` maps them by re-encoding the text up
    to each boundary instead: the only way with a slow tokenizer, and the baseline the
    benchmark compares with.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        specials: SpecialTokens,
        settings: TokenSettings,
        template_kwargs: dict | None = None,
        boundaries: str = "auto",
    ):
        if settings.thinking not in THINKING_MODES:
            raise ValueError(f"tokens.thinking must be one of {THINKING_MODES}, not {settings.thinking!r}")
        if boundaries == "auto":
            boundaries = "offsets" if tokenizer.is_fast else "prefix"
        if boundaries not in ("offsets", "prefix"):
            raise ValueError(f"boundaries must be offsets, prefix or auto, not {boundaries!r}")
        self.tokenizer = tokenizer
        self.specials = specials
        self.settings = settings
        self.template_kwargs = template_kwargs or {}
        self.boundaries = boundaries
        self.audit = Audit()
        self._empty_think = None
        if specials.think_start and specials.think_end:
            self._empty_think = re.compile(re.escape(specials.think_start) + r"(\s*)" + re.escape(specials.think_end))

    def samples_for(self, row: dict) -> list[dict]:
        """The training samples of one response row (none when the row is dropped)."""
        return self.samples_for_rows([row])

    def samples_for_rows(self, rows: list[dict]) -> list[dict]:
        """The training samples of `rows`, in order, encoded in one batch."""
        plans = [plan for row in rows for plan in self._plans(row)]
        if not plans:
            return []
        encoded = self.tokenizer(
            [p.text for p in plans], add_special_tokens=False, return_offsets_mapping=self.boundaries == "offsets"
        )
        # What the server was sent for each last turn with server IDs, in plan order.
        prompt_ids = iter(self._encode([p.prompt_text for p in plans if p.server_ids is not None]))
        if self.boundaries == "offsets":
            token_spans = [
                _token_spans(offsets, p.char_spans) for p, offsets in zip(plans, encoded["offset_mapping"], strict=True)
            ]
        else:
            token_spans = self._prefix_token_spans(plans, encoded["input_ids"])
        samples = []
        for plan, ids, spans in zip(plans, encoded["input_ids"], token_spans, strict=True):
            sample = self._finish(plan, ids, spans, next(prompt_ids) if plan.server_ids is not None else None)
            if sample is not None:
                samples.append(sample)
        return samples

    def _encode(self, texts: list[str]) -> list[list[int]]:
        return self.tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []

    def _prefix_token_spans(self, plans: list[_Plan], all_ids: list[list[int]]) -> list[list[tuple[int, int]]]:
        """Token spans by re-encoding each sample's text up to every boundary."""
        prefixes = [p.text[:c] for p in plans for span in p.char_spans for c in span]
        counts = iter(self._encode(prefixes))
        spans = []
        for plan, ids in zip(plans, all_ids, strict=True):
            # The common prefix with the whole encoding: a token that straddles a boundary
            # counts as the turn's, as with offsets.
            bounds = [len(os.path.commonprefix([next(counts), ids])) for _ in range(2 * len(plan.char_spans))]
            spans.append(list(zip(bounds[::2], bounds[1::2], strict=True)))
        return spans

    def _render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        return render_text(self.tokenizer, messages, add_generation_prompt, self.template_kwargs)

    def _plans(self, row: dict) -> list[_Plan]:
        counts = self.audit.counts
        counts["rows_in"] += 1
        if row["status"] in ("failed", "malformed"):
            counts[f"dropped_{row['status']}"] += 1
            return []
        if row["status"] == "truncated" and not self.settings.keep_truncated:
            counts["dropped_truncated"] += 1
            return []
        messages = row["messages"]
        if self.settings.thinking == "drop":
            messages = [{**m, "reasoning": ""} if m["role"] == "assistant" else m for m in messages]
        assistant_at = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        if self.settings.thinking == "keep_all":
            # Each turn is trained as the model produced it: as the last turn, reasoning shown.
            return [self._plan(f"{row['id']}/{n}", messages[: i + 1], [i]) for n, i in enumerate(assistant_at)]
        return [self._plan(row["id"], messages, assistant_at)]

    def _plan(self, sample_id: str, messages: list[dict], loss_turns: list[int]) -> _Plan:
        """A sample is the last turn's generation prompt, what the model saw, followed by that turn.

        Earlier assistant turns are trained where that prompt renders them: in their own
        generation prompt's layout, which for a prefix-stable template is how they were produced.
        """
        last = loss_turns[-1]
        history, prompt = self._history(sample_id, messages, last)
        char_spans = [self._earlier_turn_chars(sample_id, prompt, messages, i) for i in loss_turns[:-1]]
        turn = self._last_turn_text(sample_id, messages, history, prompt)
        text = prompt + turn
        text, span = self._as_generated(text, (len(prompt), len(text)), messages[last])
        char_spans.append(span)
        server = messages[last].get("output_ids")
        # Server IDs describe the last turn as generated; they apply only when the template
        # renders that turn with the reasoning it was generated with.
        if self.settings.thinking == "drop" and messages[last].get("reasoning"):
            server = None
        return _Plan(sample_id, text, char_spans, messages[last], prompt, server)

    def _history(self, sample_id: str, messages: list[dict], index: int, within: str | None = None) -> tuple[str, str]:
        """The history before turn `index` rendered alone and with the generation prompt, checked
        to be a prefix of the latter and of `within` (a longer conversation's rendering)."""
        history = self._render(messages[:index], False)
        prompt = self._render(messages[:index], True)
        within = prompt if within is None else within
        if not prompt.startswith(history) or not within.startswith(history):
            at = len(os.path.commonprefix([history, within]))
            raise BoundaryError(
                f"sample {sample_id}: the chat template is not prefix-stable at assistant turn "
                f"{messages[index].get('turn', index)} (the history rendered alone differs from its rendering "
                f"in a longer conversation at character {at}); the loss mask cannot be placed. Check "
                "model.chat_template_kwargs and tokens.thinking against the template"
            )
        return history, prompt

    def _end_of_turn(self, sample_id: str, text: str, start: int, turn: dict) -> int:
        """Where the turn starting at `start` ends: after its end-of-turn token, or before it when cut off."""
        end_of_turn = text.find(self.specials.end_of_turn, start)
        if end_of_turn < 0:
            raise BoundaryError(
                f"sample {sample_id}: no end-of-turn token {self.specials.end_of_turn!r} after assistant "
                f"turn {turn.get('turn', '?')}; check model.special_tokens.end_of_turn"
            )
        stopped = turn.get("finish_reason", "stop") == "stop"
        return end_of_turn + len(self.specials.end_of_turn) if stopped else end_of_turn

    def _earlier_turn_chars(self, sample_id: str, text: str, messages: list[dict], index: int) -> tuple[int, int]:
        """Where earlier assistant turn `index` lies in `text`.

        It starts where its history rendered with the generation prompt stops agreeing with
        `text` (a template may render the prompt's tail differently in a past turn, e.g. drop
        an empty think block) and ends with the end-of-turn token.
        """
        history, prompt = self._history(sample_id, messages, index, text)
        start = len(os.path.commonprefix([prompt, text]))
        if start <= len(history):
            raise BoundaryError(
                f"sample {sample_id}: the chat template is not prefix-stable at assistant turn "
                f"{messages[index].get('turn', index)} (its generation prompt differs from the conversation's "
                f"rendering at character {start}); check model.chat_template_kwargs against the template"
            )
        return start, self._end_of_turn(sample_id, text, start, messages[index])

    def _last_turn_text(self, sample_id: str, messages: list[dict], history: str, prompt: str) -> str:
        """The last assistant turn as the template renders it after `prompt`, to its end-of-turn token.

        `history` and `prompt` are the conversation before that turn rendered without and with
        the generation prompt. Usually the whole conversation's rendering continues `prompt`. A template may render the
        history differently once a later turn exists (Kimi-K2.5 blanks the reasoning of a tool-call
        chain after its final answer): the turn then starts after the last generation prompt header.
        """
        last = len(messages) - 1
        full = self._render(messages, False)
        if full.startswith(prompt):
            start = len(prompt)
        else:
            header = prompt[len(history) :]
            content_at = len(full) - len((messages[last].get("content") or "").strip())
            start = full.rfind(header, 0, content_at)
            if start < 0:
                raise BoundaryError(
                    f"sample {sample_id}: the chat template is not prefix-stable at assistant turn "
                    f"{messages[last].get('turn', last)} (the rendered turn lacks the generation prompt's header "
                    f"{header!r}); the loss mask cannot be placed. Check model.chat_template_kwargs and "
                    "tokens.thinking against the template"
                )
            start += len(header)
        return full[start : self._end_of_turn(sample_id, full, start, messages[last])]

    def _as_generated(self, text: str, span: tuple[int, int], turn: dict) -> tuple[str, tuple[int, int]]:
        """The trained turn as the model generated it, reasoning included.

        A template may render a completed turn with an empty think block (Kimi-K2.5's blanks
        every turn up to the last plain assistant turn): fill that block with the turn's
        reasoning, the whitespace the template left in it split around the reasoning.
        """
        reasoning = turn.get("reasoning") or ""
        start, end = span
        if not reasoning.strip() or reasoning.strip() in text[start:end] or self._empty_think is None:
            return text, span
        block = self._empty_think.search(text, start, end)
        if block is None:
            return text, span
        gap = block.group(1)
        filled = self.specials.think_start + gap[: len(gap) // 2] + reasoning + gap[len(gap) // 2 :]
        filled += self.specials.think_end
        text = text[: block.start()] + filled + text[block.end() :]
        return text, (start, end + len(filled) - (block.end() - block.start()))

    def _check_reasoning_rendered(self, sample_id: str, span: list[int], turn: dict) -> None:
        """A template may render a finished turn without its reasoning: never train on that silently."""
        reasoning = (turn.get("reasoning") or "").strip()
        if reasoning and reasoning not in self.tokenizer.decode(span, skip_special_tokens=False):
            raise ReasoningDroppedError(
                f"sample {sample_id}: the chat template renders the trained assistant turn without its "
                "reasoning and with no think block to put it in, so the rebuilt tokens would teach the draft "
                "model to skip reasoning. Use a backend that returns output_ids, or set tokens.thinking: drop "
                "to train on content only"
            )

    def _finish(
        self, plan: _Plan, ids: list[int], spans: list[tuple[int, int]], prompt_ids: list[int] | None
    ) -> dict | None:
        counts = self.audit.counts
        input_ids = ids[: spans[-1][1]]
        ids_from = "text"
        if plan.server_ids is not None:
            # What the model saw and produced: the generation prompt, then its output.
            generated = prompt_ids + plan.server_ids
            start, end = spans[-1]
            self.audit.compare(
                plan.sample_id, ids[start:end], generated[start:], self.tokenizer, self.settings.audit_examples
            )
            if self.settings.prefer_ids == "server":
                input_ids = generated
                spans[-1] = (len(prompt_ids), len(generated))
                ids_from = "server"
        if ids_from == "text":
            self._check_reasoning_rendered(plan.sample_id, ids[slice(*spans[-1])], plan.last_turn)
        loss_mask = [0] * len(input_ids)
        for start, end in spans:
            loss_mask[start:end] = [1] * (end - start)
        if len(input_ids) > self.settings.max_length:
            if self.settings.length_policy == "drop":
                counts["dropped_too_long"] += 1
                return None
            counts["truncated_to_max_length"] += 1
            input_ids = input_ids[: self.settings.max_length]
            loss_mask = loss_mask[: self.settings.max_length]
            if not any(loss_mask):
                counts["dropped_no_loss_after_truncation"] += 1
                return None
        counts["samples_out"] += 1
        counts["tokens"] += len(input_ids)
        counts["loss_tokens"] += sum(loss_mask)
        counts[f"ids_from_{ids_from}"] += 1
        return {"id": plan.sample_id, "input_ids": input_ids, "loss_mask": loss_mask}

    def report(self) -> dict:
        return {
            "settings": self.settings.__dict__,
            "boundaries": self.boundaries,
            "special_tokens": self.specials.as_dict(),
            "counts": dict(sorted(self.audit.counts.items())),
            "audit": self.audit.summary(),
        }


def _token_spans(offsets: list[tuple[int, int]], char_spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The tokens overlapping each character span; a token straddling a span's start counts as the turn's."""
    starts = [start for start, _ in offsets]
    ends = [end for _, end in offsets]
    return [(bisect.bisect_right(ends, first), bisect.bisect_left(starts, last)) for first, last in char_spans]


def loss_spans(input_ids: list[int], loss_mask: list[int]) -> list[list[int]]:
    """The token IDs of each contiguous run of loss-mask 1s, in order."""
    spans: list[list[int]] = []
    previous = 0
    for token, bit in zip(input_ids, loss_mask, strict=True):
        if bit:
            if not previous:
                spans.append([])
            spans[-1].append(token)
        previous = bit
    return spans


# Rows per encoding batch, and per task when several processes share a shard.
CHUNK_ROWS = 256
_worker_builder: TokenBuilder | None = None


def make_builder(model_path: str | Path, model_settings: dict, settings: TokenSettings) -> TokenBuilder:
    tokenizer = load_tokenizer(model_path, model_settings.get("trust_remote_code", False))
    template_kwargs = model_settings.get("chat_template_kwargs") or {}
    specials = resolve_special_tokens(tokenizer, model_settings.get("special_tokens"), template_kwargs)
    return TokenBuilder(tokenizer, specials, settings, template_kwargs)


def _one_core() -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"


def _build_chunk(rows: list[dict]) -> tuple[list[dict], Audit]:
    """Runs in a forked worker, on the builder the parent made before forking."""
    _worker_builder.audit = Audit()
    return _worker_builder.samples_for_rows(rows), _worker_builder.audit


def build_samples(
    rows: list[dict],
    model_path: str | Path,
    model_settings: dict,
    settings: TokenSettings,
    workers: int = 1,
) -> tuple[list[dict], dict]:
    """All samples of `rows` in order, and the audit report; `workers` processes share the chunks.

    The chat template is rendered in Python, one core per process: more processes, not threads,
    are what scale it.
    """
    builder = make_builder(model_path, model_settings, settings)
    log.info("special tokens: %s", builder.specials.as_dict())
    chunks = [rows[i : i + CHUNK_ROWS] for i in range(0, len(rows), CHUNK_ROWS)]
    samples: list[dict] = []
    progress = Progress(len(rows), "rows", log)
    if workers > 1 and len(chunks) > 1:
        global _worker_builder
        _worker_builder = builder
        # Forked workers inherit the loaded tokenizer; each encodes on one core.
        context = multiprocessing.get_context("fork")
        with ProcessPoolExecutor(workers, mp_context=context, initializer=_one_core) as pool:
            for chunk, (chunk_samples, audit) in zip(chunks, pool.map(_build_chunk, chunks), strict=True):
                samples.extend(chunk_samples)
                builder.audit.merge(audit, settings.audit_examples)
                progress.advance(len(chunk), tokens=sum(len(s["input_ids"]) for s in chunk_samples))
    else:
        for chunk in chunks:
            chunk_samples = builder.samples_for_rows(chunk)
            samples.extend(chunk_samples)
            progress.advance(len(chunk), tokens=sum(len(s["input_ids"]) for s in chunk_samples))
    progress.close()
    return samples, builder.report()


def run_tokens(
    responses_path: str | Path,
    out_path: str | Path,
    audit_path: str | Path,
    model_path: str | Path,
    model_settings: dict,
    settings: TokenSettings,
    workers: int = 1,
) -> dict:
    samples, report = build_samples(read_jsonl(responses_path), model_path, model_settings, settings, workers)
    rate = report["audit"]["semantic_rate"]
    if rate > settings.max_semantic_mismatch_rate:
        log.error("audit: %s", report["audit"])
        raise AuditFailure(
            f"{responses_path}: {report['audit']['semantic']} of {report['audit']['turns_compared']} turns "
            f"({rate:.2%}) rebuilt from text differ in meaning from the server's token IDs, above "
            f"tokens.max_semantic_mismatch_rate={settings.max_semantic_mismatch_rate}. The chat template or "
            "the response parsing does not match what the model generated; see the examples in the log"
        )
    report["lengths"] = {
        "sample_tokens": histogram(len(s["input_ids"]) for s in samples),
        "loss_tokens": histogram(sum(s["loss_mask"]) for s in samples),
    }
    write_jsonl_zst(out_path, samples)
    write_json(audit_path, report)
    return report
