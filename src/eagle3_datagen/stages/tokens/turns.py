"""Where each trained assistant turn lies in the chat template's rendering, and the last turn as
the model emitted it: the text side of the tokens stage (no token is encoded here).

Turn boundaries come from rendering, not from re-encoding text prefixes: an earlier assistant
turn starts where its own generation prompt stops agreeing with the last turn's prompt and ends
at the end-of-turn token the template places after it (or one of the family's turn ends: gpt-oss
ends a past answer `<|end|>`, a call `<|call|>`). The last turn is rebuilt in the model's format,
derived from the template by `chat.turns.TemplateTurns` (Kimi-K2.5's prompt opens `<think>`, so
`{reasoning}</think>{content}<|im_end|>`; Qwen3's does not, so `<think>\n{reasoning}\n</think>...`;
DeepSeek-V3.1's template never renders reasoning, gpt-oss's puts it in its analysis channel).
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from eagle3_datagen.chat.families.target_chat import Family
from eagle3_datagen.chat.template import SpecialTokens, turn_start
from eagle3_datagen.chat.turns import BoundaryError, ReasoningDroppedError, TemplateTurns

__all__ = ["BoundaryError", "ReasoningDroppedError", "TurnLocator", "TurnPlan"]

THINKING_MODES = ("keep_last", "keep_all", "drop")
LOSS_TURNS = ("all", "last")


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

    `thinking` (`keep_last`, `keep_all`, `drop`) and `loss_turns` (`all`, `last`) are the tokens
    stage's settings; `template_kwargs` are the model's `chat_template_kwargs`, `family`
    its entry in `chat.families` (the generic one when None). Which rows are trained
    at all is the gates' (`gates.Gates`): a row here is trained, a cut-off last turn (a truncated
    row the gates keep) without its end-of-turn token.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        specials: SpecialTokens,
        thinking: str,
        loss_turns: str,
        template_kwargs: dict | None = None,
        family: Family | None = None,
    ):
        if thinking not in THINKING_MODES:
            raise ValueError(f"tokens.thinking must be one of {THINKING_MODES}, not {thinking!r}")
        if loss_turns not in LOSS_TURNS:
            raise ValueError(f"tokens.loss_turns must be one of {LOSS_TURNS}, not {loss_turns!r}")
        self.thinking = thinking
        self.loss_turns = loss_turns
        self.template = TemplateTurns(tokenizer, specials, template_kwargs, family)
        self.family = self.template.family

    def plans(self, row: dict, counts: Counter) -> list[TurnPlan]:
        """The samples one response row (that the gates passed) is trained as (none when it has no
        assistant turn; `counts` says so)."""
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
        history = self.template.render(messages[:last], False, tools)
        prompt = self.template.render(messages[:last], True, tools)
        if not prompt.startswith(history):
            raise self._unstable(sample_id, messages, last, len(os.path.commonprefix([history, prompt])))
        char_spans: list[tuple[int, int]] = []
        for index in loss_turns[:-1]:
            after = char_spans[-1][1] if char_spans else 0
            char_spans.append(self._earlier_turn_chars(sample_id, prompt, messages, tools, index, after))
        continuation = self.template.emitted(sample_id, messages, tools, history, prompt)
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
        history = self.template.render(messages[:index], False, tools)
        own_prompt = self.template.render(messages[:index], True, tools)
        if prompt.startswith(history):
            start = turn_start(own_prompt, prompt, *self.template.think)
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
        return start, self.template.end_of_turn(sample_id, prompt, start, messages[index])
