"""Kimi-K2.5 (and K2.6): the DeepSeek-V3 architecture with Kimi's tokenizer and template.

The generation prompt opens `<think>` (`thinking=False` closes it empty); every turn up to the last
plain answer renders an empty think block, a tool-call chain after it keeps its reasoning. Calls:
`<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{...}
<|tool_call_end|><|tool_calls_section_end|>`, their markers read off the template (the generic
reader, `chat.tool_calls.derive_markers`).
"""

from __future__ import annotations

from collections.abc import Sequence

from eagle3_datagen.chat.families.base import Family, register
from eagle3_datagen.chat.families.deepseek import deepseek_sglang_layer_ids


@register("kimi-k2.5")
class KimiK25(Family):
    title = "Kimi-K2.5: Kimi's template on the DeepSeek-V3 architecture"
    signature = ("<|im_assistant|>", "<|im_middle|>")
    model_types = ("kimi_k25", "deepseek_v3")
    thinking_switch = "thinking"

    def sglang_layer_ids(self, aux_layers: Sequence[int]) -> list[int]:
        return deepseek_sglang_layer_ids(aux_layers)
