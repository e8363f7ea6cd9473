"""Stage 3: responses -> input_ids + loss mask, rebuilt with the model's own chat template.

Turn boundaries come from rendering, not from re-encoding text prefixes: the history
rendered alone must be a prefix of the whole conversation's rendering, a turn starts where
the history rendered with the generation prompt stops agreeing with it, and ends at the
end-of-turn token the template places after it. The loss covers the turn and its
end-of-turn token.

Where the backend returned the exact generated IDs, they are audited against the IDs
rebuilt from text and, by default, the last turn is trained on exactly what the model saw
and produced: the generation prompt followed by those IDs.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from transformers import PreTrainedTokenizerBase

from .chat import SpecialTokens, load_tokenizer, render_ids, resolve_special_tokens
from .io import read_jsonl, write_json, write_jsonl_zst

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
            if sum(1 for e in self.examples if e["kind"] == kind) < keep_examples:
                self.examples.append(
                    {
                        "id": sample_id,
                        "kind": kind,
                        "rebuilt_ids": rendered[:64],
                        "server_ids": server[:64],
                        "rebuilt_text": rendered_text[:200],
                        "server_text": server_text[:200],
                    }
                )
        self.comparisons[kind] += 1
        return kind

    def summary(self) -> dict:
        compared = sum(self.comparisons.values())
        return {
            "turns_compared": compared,
            **{kind: self.comparisons[kind] for kind in ("exact", "bpe_only", "semantic")},
            "bpe_only_rate": self.comparisons["bpe_only"] / compared if compared else 0.0,
            "semantic_rate": self.comparisons["semantic"] / compared if compared else 0.0,
            "examples": self.examples,
        }


class TokenBuilder:
    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        specials: SpecialTokens,
        settings: TokenSettings,
        template_kwargs: dict | None = None,
    ):
        if settings.thinking not in THINKING_MODES:
            raise ValueError(f"tokens.thinking must be one of {THINKING_MODES}, not {settings.thinking!r}")
        self.tokenizer = tokenizer
        self.specials = specials
        self.settings = settings
        self.template_kwargs = template_kwargs or {}
        self.audit = Audit()

    def samples_for(self, row: dict) -> list[dict]:
        """The training samples of one response row (none when the row is dropped)."""
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
            plans = [(f"{row['id']}/{n}", messages[: i + 1], [i]) for n, i in enumerate(assistant_at)]
        else:
            plans = [(row["id"], messages, assistant_at)]
        samples = []
        for sample_id, sample_messages, loss_turns in plans:
            sample = self._build(sample_id, sample_messages, loss_turns)
            if sample is not None:
                samples.append(sample)
        return samples

    def _turn_span(
        self, sample_id: str, full: list[int], messages: list[dict], index: int, prompt: list[int]
    ) -> tuple[int, int]:
        """Where assistant turn `index` lies in `full`, the rendering of the whole sample.

        The history rendered alone must be a prefix of `full`; the turn starts where the history
        rendered with the generation prompt stops agreeing with `full` (all of it for the last
        turn; for an earlier turn a template may render the prompt's suffix differently, e.g. an
        empty think block it drops from past turns) and ends at the end-of-turn token.
        """
        history = render_ids(self.tokenizer, messages[:index], False, self.template_kwargs)
        start = _common_prefix(prompt, full)
        if start <= len(history) or prompt[: len(history)] != history:
            raise BoundaryError(
                f"sample {sample_id}: the chat template is not prefix-stable at assistant turn "
                f"{messages[index].get('turn', index)} (the history rendered alone or with the generation "
                f"prompt differs from the full rendering at token {min(start, len(history))}); the loss mask "
                "cannot be placed. Check model.chat_template_kwargs and tokens.thinking against the template"
            )
        try:
            end_of_turn = full.index(self.specials.end_of_turn_id, start)
        except ValueError:
            raise BoundaryError(
                f"sample {sample_id}: no end-of-turn token {self.specials.end_of_turn!r} after assistant "
                f"turn {index}; check model.special_tokens.end_of_turn"
            ) from None
        stopped = messages[index].get("finish_reason", "stop") == "stop"
        return start, end_of_turn + 1 if stopped else end_of_turn

    def _check_reasoning_rendered(self, sample_id: str, span: list[int], turn: dict) -> None:
        """A template may render a finished turn without its reasoning: never train on that silently."""
        reasoning = (turn.get("reasoning") or "").strip()
        if reasoning and reasoning not in self.tokenizer.decode(span, skip_special_tokens=False):
            raise ReasoningDroppedError(
                f"sample {sample_id}: the chat template renders the trained assistant turn without its "
                "reasoning (Kimi-K2.5's template blanks the think block of completed turns), so the rebuilt "
                "tokens would teach the draft model to skip reasoning. Use a backend that returns output_ids, "
                "or set tokens.thinking: drop to train on content only"
            )

    def _build(self, sample_id: str, messages: list[dict], loss_turns: list[int]) -> dict | None:
        counts = self.audit.counts
        full = render_ids(self.tokenizer, messages, False, self.template_kwargs)
        # Each turn's history rendered with the generation prompt: what the model saw.
        prompts = [render_ids(self.tokenizer, messages[:i], True, self.template_kwargs) for i in loss_turns]
        spans = [self._turn_span(sample_id, full, messages, i, p) for i, p in zip(loss_turns, prompts, strict=True)]
        input_ids = full[: spans[-1][1]]
        ids_from = "text"
        last = messages[loss_turns[-1]]
        server = last.get("output_ids")
        # Server IDs describe the last turn as generated; they apply only when the template
        # renders that turn with the reasoning it was generated with.
        if server is not None and not (self.settings.thinking == "drop" and last.get("reasoning")):
            # What the model saw and produced: the generation prompt, then its output.
            generated = prompts[-1] + server
            start, end = spans[-1]
            self.audit.compare(
                sample_id, full[start:end], generated[start:], self.tokenizer, self.settings.audit_examples
            )
            if self.settings.prefer_ids == "server":
                input_ids = generated
                spans[-1] = (len(generated) - len(server), len(generated))
                ids_from = "server"
        if ids_from == "text":
            self._check_reasoning_rendered(sample_id, full[slice(*spans[-1])], last)
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
        return {"id": sample_id, "input_ids": input_ids, "loss_mask": loss_mask}

    def report(self) -> dict:
        return {
            "settings": self.settings.__dict__,
            "special_tokens": self.specials.as_dict(),
            "counts": dict(sorted(self.audit.counts.items())),
            "audit": self.audit.summary(),
        }


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


def _common_prefix(a: list[int], b: list[int]) -> int:
    return next((k for k, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def run_tokens(
    responses_path: str | Path,
    out_path: str | Path,
    audit_path: str | Path,
    model_path: str | Path,
    model_settings: dict,
    settings: TokenSettings,
) -> dict:
    tokenizer = load_tokenizer(model_path, model_settings.get("trust_remote_code", False))
    template_kwargs = model_settings.get("chat_template_kwargs") or {}
    specials = resolve_special_tokens(tokenizer, model_settings.get("special_tokens"), template_kwargs)
    log.info("special tokens: %s", specials.as_dict())
    builder = TokenBuilder(tokenizer, specials, settings, template_kwargs)
    samples = [s for row in read_jsonl(responses_path) for s in builder.samples_for(row)]
    report = builder.report()
    rate = report["audit"]["semantic_rate"]
    if rate > settings.max_semantic_mismatch_rate:
        log.error("audit: %s", report["audit"])
        raise AuditFailure(
            f"{responses_path}: {report['audit']['semantic']} of {report['audit']['turns_compared']} turns "
            f"({rate:.2%}) rebuilt from text differ in meaning from the server's token IDs, above "
            f"tokens.max_semantic_mismatch_rate={settings.max_semantic_mismatch_rate}. The chat template or "
            "the response parsing does not match what the model generated; see the examples in the log"
        )
    write_jsonl_zst(out_path, samples)
    write_json(audit_path, report)
    return report
