"""Stage 3: responses -> input_ids + loss mask, rebuilt with the model's own chat template.

Each regenerated turn is trained as the model emitted it: its generation prompt (the history
rendered with `add_generation_prompt`, tools declared) followed by exactly what the model
produced after it. With the server's generated IDs that is those IDs; from text it is the turn
rebuilt in the model's format, derived from the template (Kimi-K2.5's prompt opens `<think>`, so
`{reasoning}</think>{content}<|im_end|>`; Qwen3's does not, so `<think>\n{reasoning}\n</think>...`).
Where both exist they are audited against each other, continuation against continuation.

Turn boundaries come from rendering, not from re-encoding text prefixes: an earlier assistant
turn starts where its own generation prompt stops agreeing with the last turn's prompt and ends
at the end-of-turn token the template places after it. Prompts are encoded whole; boundaries
map to tokens through the tokenizer's offsets.
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

from eagle3_datagen.chat.template import (
    SpecialTokens,
    load_tokenizer,
    render_text,
    resolve_special_tokens,
    tools_rendering,
)
from eagle3_datagen.chat.tiktoken_fast import fast_tokenizer_from_tiktoken
from eagle3_datagen.formats.files import read_jsonl, write_json, write_jsonl_zst
from eagle3_datagen.formats.histograms import histogram
from eagle3_datagen.progress import Progress

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
    """One sample between rendering and encoding: the last turn's generation prompt, where the
    earlier trained turns lie in it, and that turn rebuilt as the model emitted it."""

    sample_id: str
    prompt: str  # the last turn's generation prompt: what the model saw
    char_spans: list[tuple[int, int]]  # earlier trained turns, as characters of `prompt`
    continuation: str  # the last turn as the model emitted it, rebuilt from text
    server_ids: list[int] | None  # the last turn's generated IDs, when they apply
    server_prompt_tokens: int | None  # how many prompt tokens the server counted for that turn


class TokenBuilder:
    """Response rows -> training samples, a batch of rows at a time.

    A sample is the trained turn's generation prompt followed by what the model produced after
    it: the server's IDs when it returned them, else the turn rebuilt from text in the model's
    own format (derived from the template: what it renders after the generation prompt, the
    turn's reasoning filled into the think block the prompt opens or the turn carries). Earlier
    assistant turns are trained where that prompt renders them. `tokenizer` renders (its own
    `apply_chat_template`, tools included); `encoder` encodes, by default the same tokenizer;
    `reference`, when given, is the model's own tokenizer that every text `encoder` encodes is
    checked against: a text on which they differ is encoded by `reference` instead.

    Prompts are encoded whole and earlier turns mapped to tokens through the encoder's offsets;
    `boundaries="prefix"` re-encodes the prompt up to each boundary instead: the only way with a
    slow tokenizer, and the baseline the benchmark compares with.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        specials: SpecialTokens,
        settings: TokenSettings,
        template_kwargs: dict | None = None,
        boundaries: str = "auto",
        encoder: PreTrainedTokenizerBase | None = None,
        reference: PreTrainedTokenizerBase | None = None,
    ):
        if settings.thinking not in THINKING_MODES:
            raise ValueError(f"tokens.thinking must be one of {THINKING_MODES}, not {settings.thinking!r}")
        self.encoder = encoder or tokenizer
        if boundaries == "auto":
            boundaries = "offsets" if self.encoder.is_fast else "prefix"
        if boundaries not in ("offsets", "prefix"):
            raise ValueError(f"boundaries must be offsets, prefix or auto, not {boundaries!r}")
        self.tokenizer = tokenizer
        self.reference = reference
        self.specials = specials
        self.settings = settings
        self.template_kwargs = template_kwargs or {}
        self.boundaries = boundaries
        self.audit = Audit()
        self.tools_rendering = tools_rendering(tokenizer, self.template_kwargs)
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
        prompts, spans = self._encode_prompts(plans, self.encoder, self.boundaries)
        continuations = _encode(self.encoder, [p.continuation for p in plans])
        if self.reference is not None:
            self._check_against_reference(plans, prompts, spans, continuations)
        samples = []
        for plan, prompt_ids, turn_spans, rebuilt in zip(plans, prompts, spans, continuations, strict=True):
            sample = self._finish(plan, prompt_ids, turn_spans, rebuilt)
            if sample is not None:
                samples.append(sample)
        return samples

    def _encode_prompts(
        self, plans: list[_Plan], encoder: PreTrainedTokenizerBase, boundaries: str
    ) -> tuple[list[list[int]], list[list[tuple[int, int]]]]:
        """Each plan's prompt IDs and the token spans of its earlier trained turns."""
        texts = [p.prompt for p in plans]
        if boundaries == "offsets":
            encoded = encoder(texts, add_special_tokens=False, return_offsets_mapping=True)
            spans = [
                _token_spans(offsets, p.char_spans) for p, offsets in zip(plans, encoded["offset_mapping"], strict=True)
            ]
            return encoded["input_ids"], spans
        ids = _encode(encoder, texts)
        # Each boundary by re-encoding the prompt up to it; the common prefix with the whole
        # encoding, so a token that straddles a boundary counts as the turn's, as with offsets.
        counts = iter(_encode(encoder, [p.prompt[:c] for p in plans for span in p.char_spans for c in span]))
        spans = []
        for plan, prompt_ids in zip(plans, ids, strict=True):
            bounds = [len(os.path.commonprefix([next(counts), prompt_ids])) for _ in range(2 * len(plan.char_spans))]
            spans.append(list(zip(bounds[::2], bounds[1::2], strict=True)))
        return ids, spans

    def _check_against_reference(
        self,
        plans: list[_Plan],
        prompts: list[list[int]],
        spans: list[list[tuple[int, int]]],
        continuations: list[list[int]],
    ) -> None:
        """Every text encoded as the model's own tokenizer encodes it; a plan where the encoder
        differs is encoded by the model's tokenizer instead, its boundaries by re-encoding."""
        reference_prompts = _encode(self.reference, [p.prompt for p in plans])
        reference_continuations = _encode(self.reference, [p.continuation for p in plans])
        for k, plan in enumerate(plans):
            if prompts[k] == reference_prompts[k] and continuations[k] == reference_continuations[k]:
                self.audit.counts["encoder_checked_samples"] += 1
                continue
            self.audit.counts["encoder_mismatched_samples"] += 1
            log.warning("sample %s: the fast tokenizer differs from the model's; using the model's", plan.sample_id)
            [prompts[k]], [spans[k]] = self._encode_prompts([plan], self.reference, "prefix")
            continuations[k] = reference_continuations[k]

    def _render(self, messages: list[dict], add_generation_prompt: bool, tools: list[dict] | None) -> str:
        return render_text(self.tokenizer, messages, add_generation_prompt, self.template_kwargs, tools)

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
        tools = row.get("tools")
        if tools:
            counts["rows_with_tools"] += 1
        if self.settings.thinking == "drop":
            messages = [{**m, "reasoning": ""} if m["role"] == "assistant" else m for m in messages]
        assistant_at = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        if not assistant_at:
            counts["dropped_no_assistant_turn"] += 1
            return []
        # Server IDs describe a turn as generated; with tokens.thinking: drop a turn that
        # reasoned is trained without its reasoning, so its IDs do not apply.
        ids_apply = [self.settings.thinking != "drop" or not m.get("reasoning") for m in row["messages"]]
        if self.settings.thinking == "keep_all":
            # Each turn is trained as the model produced it: as the last turn, reasoning shown.
            return [
                self._plan(f"{row['id']}/{n}", messages[: i + 1], tools, [i], ids_apply[i])
                for n, i in enumerate(assistant_at)
            ]
        last = assistant_at[-1]
        return [self._plan(row["id"], messages[: last + 1], tools, assistant_at, ids_apply[last])]

    def _plan(
        self, sample_id: str, messages: list[dict], tools: list[dict] | None, loss_turns: list[int], ids_apply: bool
    ) -> _Plan:
        """The last turn's generation prompt, what the model saw, with the earlier trained turns
        located in it, followed by that turn as the model emitted it."""
        last = loss_turns[-1]
        history = self._render(messages[:last], False, tools)
        prompt = self._render(messages[:last], True, tools)
        if not prompt.startswith(history):
            raise self._unstable(sample_id, messages, last, len(os.path.commonprefix([history, prompt])))
        char_spans: list[tuple[int, int]] = []
        for index in loss_turns[:-1]:
            after = char_spans[-1][1] if char_spans else 0
            char_spans.append(self._earlier_turn_chars(sample_id, prompt, messages, tools, index, after))
        continuation = self._continuation(sample_id, messages, tools, history, prompt)
        server = messages[last].get("output_ids") if ids_apply else None
        server_prompt_tokens = (messages[last].get("usage") or {}).get("prompt_tokens") if server else None
        return _Plan(sample_id, prompt, char_spans, continuation, server, server_prompt_tokens)

    def _unstable(self, sample_id: str, messages: list[dict], index: int, at: int) -> BoundaryError:
        return BoundaryError(
            f"sample {sample_id}: the chat template is not prefix-stable at assistant turn "
            f"{messages[index].get('turn', index)} (the history rendered alone differs from its rendering "
            f"with the generation prompt or in a longer conversation at character {at}); the loss mask cannot "
            "be placed. Check model.chat_template_kwargs and tokens.thinking against the template"
        )

    def _end_of_turn(self, sample_id: str, text: str, start: int, turn: dict) -> int:
        """Where the turn starting at `start` ends: after its end-of-turn token, or before it when cut off."""
        end_of_turn = text.find(self.specials.end_of_turn, start)
        if end_of_turn < 0:
            raise BoundaryError(
                f"sample {sample_id}: no end-of-turn token {self.specials.end_of_turn!r} after assistant "
                f"turn {turn.get('turn', '?')}; check model.special_tokens.end_of_turn"
            )
        # "stop" and "tool_calls" both end with the end-of-turn token; "length" cuts before it.
        cut_off = turn.get("finish_reason", "stop") == "length"
        return end_of_turn if cut_off else end_of_turn + len(self.specials.end_of_turn)

    def _earlier_turn_chars(
        self, sample_id: str, prompt: str, messages: list[dict], tools: list[dict] | None, index: int, after: int
    ) -> tuple[int, int]:
        """Where earlier assistant turn `index` lies in `prompt`, the last turn's generation prompt.

        It starts where its own generation prompt stops agreeing with `prompt` (the template may
        render the prompt's tail differently in a past turn, e.g. close an empty think block) and
        ends with the end-of-turn token. A template may render the history differently once a
        later turn exists (Kimi-K2.5 blanks a tool-call chain's reasoning after its final answer):
        the turn then starts after the first generation prompt header past `after`, the end of the
        previous trained turn.
        """
        history = self._render(messages[:index], False, tools)
        own_prompt = self._render(messages[:index], True, tools)
        if prompt.startswith(history):
            start = len(os.path.commonprefix([own_prompt, prompt]))
            if start <= len(history):
                raise self._unstable(sample_id, messages, index, start)
        else:
            header = own_prompt[len(history) :]
            found = prompt.find(header, after)
            if not header or found < 0:
                raise self._unstable(sample_id, messages, index, len(os.path.commonprefix([history, prompt])))
            start = found + len(header)
        return start, self._end_of_turn(sample_id, prompt, start, messages[index])

    def _continuation(
        self, sample_id: str, messages: list[dict], tools: list[dict] | None, history: str, prompt: str
    ) -> str:
        """The last assistant turn as the model emitted it after `prompt`, to its end-of-turn token.

        What the template renders after the generation prompt when the turn closes the
        conversation, with the turn's reasoning filled into an empty think block when the
        template blanks it (Kimi-K2.5 renders every turn up to the last plain answer as
        `<think></think>`, the `<think>` already in its generation prompt). The whole
        conversation's rendering usually continues `prompt`; where a later turn changes how the
        history renders (Kimi-K2.5 blanks a tool-call chain's reasoning once its final answer
        exists) the turn starts after the last generation prompt header.
        """
        last = len(messages) - 1
        turn = messages[last]
        full = self._render(messages, False, tools)
        if full.startswith(prompt):
            start = len(prompt)
        else:
            header = prompt[len(history) :]
            content_at = len(full) - len((turn.get("content") or "").strip())
            found = full.rfind(header, 0, content_at) if header else -1
            if found < 0:
                raise BoundaryError(
                    f"sample {sample_id}: the chat template is not prefix-stable at assistant turn "
                    f"{turn.get('turn', last)} (the rendered turn lacks the generation prompt's header "
                    f"{header!r}); the loss mask cannot be placed. Check model.chat_template_kwargs and "
                    "tokens.thinking against the template"
                )
            start = found + len(header)
        text = prompt + full[start : self._end_of_turn(sample_id, full, start, turn)]
        return self._with_reasoning(sample_id, text, len(history), len(prompt), turn)[len(prompt) :]

    def _with_reasoning(self, sample_id: str, text: str, header_at: int, turn_at: int, turn: dict) -> str:
        """`text` (history, generation prompt header from `header_at`, the turn from `turn_at`) with
        the turn's reasoning where the model wrote it: already rendered before the turn's
        think-end token, or filled into the empty think block that the header or the turn holds."""
        reasoning = (turn.get("reasoning") or "").strip()
        if not reasoning:
            return text
        think_end_at = text.find(self.specials.think_end, turn_at) if self.specials.think_end else -1
        if think_end_at >= 0 and reasoning in text[turn_at:think_end_at]:
            return text
        block = self._empty_think.search(text, header_at) if self._empty_think is not None else None
        if block is None or block.end() <= turn_at:
            raise ReasoningDroppedError(
                f"sample {sample_id}: the chat template renders the trained assistant turn without its "
                "reasoning and with no think block to put it in, so the model's format cannot be derived from "
                "it and rebuilt tokens would teach the draft model to skip reasoning. Use a backend that "
                "returns output_ids, or set tokens.thinking: drop to train on content only"
            )
        # Into the middle of the whitespace the template left in the block, past the part of it
        # that the generation prompt already holds.
        gap_at, gap = block.start(1), block.group(1)
        at = gap_at + min(len(gap), max(len(gap) // 2, turn_at - gap_at))
        return text[:at] + turn["reasoning"] + text[at:]

    def _finish(
        self, plan: _Plan, prompt_ids: list[int], spans: list[tuple[int, int]], rebuilt: list[int]
    ) -> dict | None:
        counts = self.audit.counts
        output = rebuilt
        ids_from = "text"
        if plan.server_ids is not None:
            self.audit.compare(plan.sample_id, rebuilt, plan.server_ids, self.encoder, self.settings.audit_examples)
            # The prompt the server counted and the one rendered here should be the same IDs
            # (a difference: tools or template settings not as in generation).
            if plan.server_prompt_tokens not in (None, len(prompt_ids)):
                counts["server_prompt_length_differs"] += 1
            if self.settings.prefer_ids == "server":
                output = list(plan.server_ids)
                ids_from = "server"
        input_ids = prompt_ids + output
        loss_mask = [0] * len(input_ids)
        for start, end in [*spans, (len(prompt_ids), len(input_ids))]:
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
            "tokenizer": self.describe_tokenizer(),
            "boundaries": self.boundaries,
            "tools_rendering": self.tools_rendering,
            "special_tokens": self.specials.as_dict(),
            "counts": dict(sorted(self.audit.counts.items())),
            "audit": self.audit.summary(),
        }

    def describe_tokenizer(self) -> dict:
        """Which tokenizer rendered and which encoded, and whether the encoder was checked."""
        return {
            "model": f"{type(self.tokenizer).__name__} ({'fast' if self.tokenizer.is_fast else 'slow'})",
            "encoder": "model" if self.encoder is self.tokenizer else f"{type(self.encoder).__name__} (fast)",
            "checked_against_model": self.reference is not None,
        }


def _encode(tokenizer: PreTrainedTokenizerBase, texts: list[str]) -> list[list[int]]:
    return tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []


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
    """The builder for a model directory. A slow tokenizer beside a `tiktoken.model` (Kimi's
    remote-code `TikTokenTokenizer`) keeps rendering, and a fast tokenizer built from the same
    files encodes, checked against the model's own on every text."""
    tokenizer = load_tokenizer(model_path, model_settings.get("trust_remote_code", False))
    template_kwargs = model_settings.get("chat_template_kwargs") or {}
    specials = resolve_special_tokens(tokenizer, model_settings.get("special_tokens"), template_kwargs)
    encoder = reference = None
    if not tokenizer.is_fast and (Path(model_path) / "tiktoken.model").exists():
        encoder, reference = fast_tokenizer_from_tiktoken(model_path), tokenizer
    return TokenBuilder(tokenizer, specials, settings, template_kwargs, encoder=encoder, reference=reference)


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
