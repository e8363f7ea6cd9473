"""Where each trained assistant turn lies in the chat template's rendering, and the last turn as
the model emitted it: the text side of the tokens stage (no token is encoded here).

Turn boundaries come from rendering, not from re-encoding text prefixes: an earlier assistant
turn starts where its own generation prompt stops agreeing with the last turn's prompt and ends
at the end-of-turn token the template places after it (or one of the family's turn ends: gpt-oss
ends a past answer `<|end|>`, a call `<|call|>`). The last turn is rebuilt in the model's format,
derived from the template (Kimi-K2.5's prompt opens `<think>`, so `{reasoning}</think>{content}<|im_end|>`;
Qwen3's does not, so `<think>\n{reasoning}\n</think>...`; DeepSeek-V3.1's never renders reasoning,
which goes before the `</think>` that closes the block its prompt opened; gpt-oss's in its analysis
channel). The template reads the messages in the layout of the model's family (`chat.families`).
"""

from __future__ import annotations

import os
import re
from collections import Counter
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from eagle3_datagen.chat.families import Family
from eagle3_datagen.chat.template import SpecialTokens, render_text, turn_start

THINKING_MODES = ("keep_last", "keep_all", "drop")
LOSS_TURNS = ("all", "last")


class BoundaryError(ValueError):
    """The chat template is not prefix-stable at an assistant turn's start."""


class ReasoningDroppedError(ValueError):
    """The template would drop the reasoning of the turn being trained."""


@dataclass
class TurnPlan:
    """One sample between rendering and encoding: the last turn's generation prompt, where the
    earlier trained turns lie in it, and that turn rebuilt as the model emitted it."""

    sample_id: str
    prompt: str  # the last turn's generation prompt: what the model saw
    char_spans: list[tuple[int, int]]  # earlier trained turns, as characters of `prompt`
    continuation: str  # the last turn as the model emitted it, rebuilt from text
    server_ids: list[int] | None  # the last turn's generated IDs, when they apply
    server_prompt_tokens: int | None  # how many prompt tokens the server counted for that turn


class TurnLocator:
    """Response rows -> `TurnPlan`s, rendered with the model's own tokenizer and template.

    `thinking` (`keep_last`, `keep_all`, `drop`), `keep_truncated` and `loss_turns` (`all`, `last`)
    are the tokens stage's settings; `template_kwargs` are the model's `chat_template_kwargs`, `family`
    its entry in `chat.families` (the generic one when None).
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        specials: SpecialTokens,
        thinking: str,
        keep_truncated: bool,
        loss_turns: str,
        template_kwargs: dict | None = None,
        family: Family | None = None,
    ):
        if thinking not in THINKING_MODES:
            raise ValueError(f"tokens.thinking must be one of {THINKING_MODES}, not {thinking!r}")
        if loss_turns not in LOSS_TURNS:
            raise ValueError(f"tokens.loss_turns must be one of {LOSS_TURNS}, not {loss_turns!r}")
        self.tokenizer = tokenizer
        self.specials = specials
        self.thinking = thinking
        self.keep_truncated = keep_truncated
        self.loss_turns = loss_turns
        self.template_kwargs = template_kwargs or {}
        self.family = family or Family()
        self._think = (specials.think_start, specials.think_end)
        self._empty_think = None
        if specials.think_start and specials.think_end:
            self._empty_think = re.compile(re.escape(specials.think_start) + r"(\s*)" + re.escape(specials.think_end))

    def _render(self, messages: list[dict], add_generation_prompt: bool, tools: list[dict] | None) -> str:
        return render_text(self.tokenizer, messages, add_generation_prompt, self.template_kwargs, tools, self.family)

    def plans(self, row: dict, counts: Counter) -> list[TurnPlan]:
        """The samples one response row is trained as (none when it is dropped; `counts` says why)."""
        counts["rows_in"] += 1
        if row["status"] in ("failed", "malformed"):
            counts[f"dropped_{row['status']}"] += 1
            return []
        if row["status"] == "truncated" and not self.keep_truncated:
            counts["dropped_truncated"] += 1
            return []
        messages = row["messages"]
        tools = row.get("tools")
        if tools:
            counts["rows_with_tools"] += 1
        if self.thinking == "drop":
            messages = [{**m, "reasoning": ""} if m["role"] == "assistant" else m for m in messages]
        assistant_at = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        if not assistant_at:
            counts["dropped_no_assistant_turn"] += 1
            return []
        if not self.family.parallel_tool_calls and any(len(m.get("tool_calls") or ()) > 1 for m in messages):
            # the template would render one of the turn's calls (gpt-oss) or raise (Llama 3.1)
            counts["dropped_parallel_tool_calls"] += 1
            return []
        # Server IDs describe a turn as generated; with tokens.thinking: drop a turn that
        # reasoned is trained without its reasoning, so its IDs do not apply.
        ids_apply = [self.thinking != "drop" or not m.get("reasoning") for m in row["messages"]]
        if self.thinking == "keep_all":
            # Each turn is trained as the model produced it: as the last turn, reasoning shown.
            return [
                self._plan(f"{row['id']}/{n}", messages[: i + 1], tools, [i], ids_apply[i])
                for n, i in enumerate(assistant_at)
            ]
        last = assistant_at[-1]
        trained = assistant_at if self.loss_turns == "all" else [last]
        return [self._plan(row["id"], messages[: last + 1], tools, trained, ids_apply[last])]

    def _plan(
        self, sample_id: str, messages: list[dict], tools: list[dict] | None, loss_turns: list[int], ids_apply: bool
    ) -> TurnPlan:
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
        return TurnPlan(sample_id, prompt, char_spans, continuation, server, server_prompt_tokens)

    def _unstable(self, sample_id: str, messages: list[dict], index: int, at: int) -> BoundaryError:
        return BoundaryError(
            f"sample {sample_id}: the chat template is not prefix-stable at assistant turn "
            f"{messages[index].get('turn', index)} (the history rendered alone differs from its rendering "
            f"with the generation prompt or in a longer conversation at character {at}); the loss mask cannot "
            "be placed. Check model.chat_template_kwargs and tokens.thinking against the template"
        )

    def _end_of_turn(self, sample_id: str, text: str, start: int, turn: dict) -> int:
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
            start = turn_start(own_prompt, prompt, *self._think)
            if start is None:
                start = len(os.path.commonprefix([own_prompt, prompt]))
            # (a template may put no header before a turn: DeepSeek-V3.1's answer after tool output)
            if start < len(history) or start == len(history) < len(own_prompt):
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
        start = turn_start(prompt, full, *self._think)
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
