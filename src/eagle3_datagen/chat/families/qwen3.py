"""Qwen3 and Qwen3-2507, dense and MoE: ChatML turns, `<think>` blocks, Hermes-style tool calls.

Two templates share the tokenizer: Qwen3-2507 Thinking's generation prompt opens the think block
(`<|im_start|>assistant\n<think>\n`: the model writes `{reasoning}\n</think>\n\n{answer}<|im_end|>`);
the hybrid template's (Qwen3-8B and kin) does not, and `enable_thinking=False` closes an empty one.
Both render reasoning only for assistant turns after the last user query. Calls are
`<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>` in the content, several per turn;
results go back in a user turn as `<tool_response>...</tool_response>`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING

from eagle3_datagen.chat.families.base import Family, register
from eagle3_datagen.chat.tool_calls import declared_call

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

CALL_OPEN, CALL_CLOSE = "<tool_call>\n", "\n</tool_call>"
HERMES_CALL = re.compile(re.escape(CALL_OPEN) + r"(.*?)" + re.escape(CALL_CLOSE), re.DOTALL)


class HermesToolCalls:
    """Calls as SGLang's `qwen25` parser (`Qwen25Detector.detect_and_parse`) reads them: each JSON
    object between `<tool_call>\\n` and `\\n</tool_call>`; the content is the text before the first."""

    def split(self, text: str, tools: Sequence[dict] | None, first_index: int) -> tuple[str, list[dict] | None]:
        at = text.find(CALL_OPEN)
        if at < 0:
            return text, None
        calls = []
        for body in HERMES_CALL.findall(text):
            try:
                call = json.loads(body.strip())
            except ValueError:
                continue
            found = declared_call(call, tools, first_index + len(calls))
            if found is not None:
                calls.append(found)
        return (text[:at].strip(), calls) if calls else (text, [])


@register("qwen3")
class Qwen3(Family):
    title = "Qwen3 and Qwen3-2507 (dense and MoE): ChatML, <think> blocks, Hermes tool calls"
    signature = ("<|im_start|>", "<think>", "<tool_call>", "<tool_response>")
    model_types = ("qwen3", "qwen3_moe")
    thinking_switch = "enable_thinking"  # the hybrid template only; 2507 Thinking always reasons

    def tool_call_parser(self, tokenizer: PreTrainedTokenizerBase, template_kwargs: dict | None) -> HermesToolCalls:
        return HermesToolCalls()
