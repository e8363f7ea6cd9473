"""Token IDs for `TurnPlan`s: each prompt encoded whole, earlier turns mapped to tokens through the
encoder's character offsets (or by re-encoding prefixes with a slow tokenizer), optionally checked
against the model's own tokenizer."""

from __future__ import annotations

import bisect
import logging
import os
from collections import Counter

from transformers import PreTrainedTokenizerBase

from eagle3_datagen.stages.tokens.turns import TurnPlan

log = logging.getLogger(__name__)


class PlanEncoder:
    """`encoder` encodes; `reference`, when given, is the model's own tokenizer that every text
    `encoder` encodes is checked against: a text on which they differ is encoded by `reference`.
    `boundaries`: `offsets` (a fast encoder) or `prefix` (re-encode the prompt up to each boundary:
    the only way with a slow tokenizer, and the baseline the benchmark compares with); `auto` picks.
    """

    def __init__(
        self,
        encoder: PreTrainedTokenizerBase,
        reference: PreTrainedTokenizerBase | None = None,
        boundaries: str = "auto",
    ):
        if boundaries == "auto":
            boundaries = "offsets" if encoder.is_fast else "prefix"
        if boundaries not in ("offsets", "prefix"):
            raise ValueError(f"boundaries must be offsets, prefix or auto, not {boundaries!r}")
        self.encoder = encoder
        self.reference = reference
        self.boundaries = boundaries

    def encode(
        self, plans: list[TurnPlan], counts: Counter
    ) -> tuple[list[list[int]], list[list[tuple[int, int]]], list[list[int]]]:
        """Per plan: its prompt's IDs, the token spans of its earlier trained turns, and the last
        turn's rebuilt IDs."""
        prompts, spans = self.prompts(plans, self.encoder, self.boundaries)
        continuations = encode_texts(self.encoder, [p.continuation for p in plans])
        if self.reference is not None:
            self._check_against_reference(counts, plans, prompts, spans, continuations)
        return prompts, spans, continuations

    def prompts(
        self, plans: list[TurnPlan], encoder: PreTrainedTokenizerBase, boundaries: str
    ) -> tuple[list[list[int]], list[list[tuple[int, int]]]]:
        """Each plan's prompt IDs and the token spans of its earlier trained turns."""
        texts = [p.prompt for p in plans]
        if boundaries == "offsets":
            encoded = encoder(texts, add_special_tokens=False, return_offsets_mapping=True)
            spans = [
                _token_spans(offsets, p.char_spans) for p, offsets in zip(plans, encoded["offset_mapping"], strict=True)
            ]
            return encoded["input_ids"], spans
        ids = encode_texts(encoder, texts)
        # Each boundary by re-encoding the prompt up to it; the common prefix with the whole
        # encoding, so a token that straddles a boundary counts as the turn's, as with offsets.
        counts = iter(encode_texts(encoder, [p.prompt[:c] for p in plans for span in p.char_spans for c in span]))
        spans = []
        for plan, prompt_ids in zip(plans, ids, strict=True):
            bounds = [len(os.path.commonprefix([next(counts), prompt_ids])) for _ in range(2 * len(plan.char_spans))]
            spans.append(list(zip(bounds[::2], bounds[1::2], strict=True)))
        return ids, spans

    def _check_against_reference(
        self,
        counts: Counter,
        plans: list[TurnPlan],
        prompts: list[list[int]],
        spans: list[list[tuple[int, int]]],
        continuations: list[list[int]],
    ) -> None:
        """Every text encoded as the model's own tokenizer encodes it; a plan where the encoder
        differs is encoded by the model's tokenizer instead, its boundaries by re-encoding."""
        reference_prompts = encode_texts(self.reference, [p.prompt for p in plans])
        reference_continuations = encode_texts(self.reference, [p.continuation for p in plans])
        for k, plan in enumerate(plans):
            if prompts[k] == reference_prompts[k] and continuations[k] == reference_continuations[k]:
                counts["encoder_checked_samples"] += 1
                continue
            counts["encoder_mismatched_samples"] += 1
            log.warning("sample %s: the fast tokenizer differs from the model's; using the model's", plan.sample_id)
            [prompts[k]], [spans[k]] = self.prompts([plan], self.reference, "prefix")
            continuations[k] = reference_continuations[k]


def encode_texts(tokenizer: PreTrainedTokenizerBase, texts: list[str]) -> list[list[int]]:
    return tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []


def _token_spans(offsets: list[tuple[int, int]], char_spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The tokens overlapping each character span; a token straddling a span's start counts as the turn's."""
    starts = [start for start, _ in offsets]
    ends = [end for _, end in offsets]
    return [(bisect.bisect_right(ends, first), bisect.bisect_left(starts, last)) for first, last in char_spans]
