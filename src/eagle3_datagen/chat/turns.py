"""A chat template's renderings of a conversation's assistant turns: where a turn ends in a rendering,
and the last turn as the model emitted it after its generation prompt.

The model's format is derived from the template, not written per model: what the template renders
after the generation prompt when the turn closes the conversation, cut at the end-of-turn token (or at
one of the family's turn ends that its next message does not continue: gpt-oss's `<|end|>` between an
analysis and the answer), with the turn's reasoning put where the model wrote it when the template
leaves it out: into the empty think block it renders (Kimi-K2.5), or before the `</think>` that closes
the block the prompt opened (DeepSeek-V3.1). The tokens stage trains on it; the tiny targets are fitted
to emit it.
"""

from __future__ import annotations

import os
import re

from transformers import PreTrainedTokenizerBase

from eagle3_datagen.chat.families.base import Family
from eagle3_datagen.chat.template import SpecialTokens, render_text, turn_start


class BoundaryError(ValueError):
    """The chat template is not prefix-stable at an assistant turn's start."""


class ReasoningDroppedError(ValueError):
    """The template would drop the reasoning of the turn being trained."""


class TemplateTurns:
    """A model's template renderings, in its family's message layout (`family`; generic when None)."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        specials: SpecialTokens,
        template_kwargs: dict | None = None,
        family: Family | None = None,
    ):
        self.tokenizer = tokenizer
        self.specials = specials
        self.template_kwargs = template_kwargs or {}
        self.family = family or Family()
        self.think = (specials.think_start, specials.think_end)
        self._empty_think = None
        if specials.think_start and specials.think_end:
            self._empty_think = re.compile(re.escape(specials.think_start) + r"(\s*)" + re.escape(specials.think_end))

    def render(self, messages: list[dict], add_generation_prompt: bool, tools: list[dict] | None) -> str:
        return render_text(self.tokenizer, messages, add_generation_prompt, self.template_kwargs, tools, self.family)

    def end_of_turn(self, sample_id: str, text: str, start: int, turn: dict) -> int:
        """Where the turn starting at `start` ends: after its end-of-turn token (or one of the family's
        turn ends that the family's next message does not continue), or before it when cut off."""
        ends = [self.specials.end_of_turn, *self.specials.turn_ends]
        at = start
        while True:
            found = [(i, token) for token in ends if (i := text.find(token, at)) >= 0]
            if not found:
                raise BoundaryError(
                    f"sample {sample_id}: no end-of-turn token {' or '.join(map(repr, ends))} after assistant "
                    f"turn {turn.get('turn', '?')}; check model.special_tokens.end_of_turn"
                )
            end, token = min(found)
            at = end + len(token)
            if not (self.family.turn_continues and text.startswith(self.family.turn_continues, at)):
                break
        # "stop" and "tool_calls" both end with the end-of-turn token; "length" cuts before it.
        cut_off = turn.get("finish_reason", "stop") == "length"
        return end if cut_off else at

    def emitted(self, sample_id: str, messages: list[dict], tools: list[dict] | None, history: str, prompt: str) -> str:
        """The last of `messages`, an assistant turn, as the model emitted it after `prompt` (its
        generation prompt; `history`: the messages before it rendered alone), to its end-of-turn token.

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
        full = self.render(messages, False, tools)
        start = turn_start(prompt, full, *self.think)
        if start is None:
            # The turn's header is the last one before what the turn renders first: its reasoning
            # where the template shows it (gpt-oss's analysis), else its content.
            header = prompt[len(history) :]
            reasoning = (turn.get("reasoning") or "").strip()
            shown_at = full.find(reasoning, len(os.path.commonprefix([history, full]))) if reasoning else -1
            content_at = shown_at if shown_at >= 0 else len(full) - len((turn.get("content") or "").strip())
            found = full.rfind(header, 0, content_at) if header else -1
            if found < 0:
                raise BoundaryError(
                    f"sample {sample_id}: the chat template is not prefix-stable at assistant turn "
                    f"{turn.get('turn', last)} (the rendered turn lacks the generation prompt's header "
                    f"{header!r}); the loss mask cannot be placed. Check model.chat_template_kwargs and "
                    "tokens.thinking against the template"
                )
            start = found + len(header)
        text = prompt + full[start : self.end_of_turn(sample_id, full, start, turn)]
        return self._with_reasoning(sample_id, text, len(history), len(prompt), turn)[len(prompt) :]

    def _with_reasoning(self, sample_id: str, text: str, header_at: int, turn_at: int, turn: dict) -> str:
        """`text` (history, generation prompt header from `header_at`, the turn from `turn_at`) with
        the turn's reasoning where the model wrote it: already rendered before the turn's
        think-end token, or filled into the empty think block that the header or the turn holds."""
        reasoning = (turn.get("reasoning") or "").strip()
        if not reasoning:
            return text
        think_end_at = text.find(self.specials.think_end, turn_at) if self.specials.think_end else -1
        if reasoning in text[turn_at : think_end_at if think_end_at >= 0 else len(text)]:
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
