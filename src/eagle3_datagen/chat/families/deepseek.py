"""DeepSeek-V3.1 (and V3.1-Terminus, V3.2-Exp, which ship the same template): the DeepSeek-V3 architecture.

The template writes the BOS token itself and never renders reasoning: every assistant turn after a
user turn is `<｜Assistant｜></think>{answer}<｜end▁of▁sentence｜>`, one after tool output `{answer}` and
the end token. Its switch is `thinking` (default off: the generation prompt ends
`<｜Assistant｜></think>`); with `thinking=True` the prompt ends `<｜Assistant｜><think>` and the model
writes `{reasoning}</think>{answer}<｜end▁of▁sentence｜>`, which the tokens stage trains as written.
Calls: `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>{name}<｜tool▁sep｜>{arguments}<｜tool▁call▁end｜>...
<｜tool▁calls▁end｜>`, arguments a JSON string; results `<｜tool▁output▁begin｜>...<｜tool▁output▁end｜>`.
The template ignores `tools`: declarations go in the system prompt (the model card's format).
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

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
ONE_CALL = re.compile(r"<｜tool▁call▁begin｜>.*?<｜tool▁call▁end｜>", re.DOTALL)
CALL_PARTS = re.compile(r"<｜tool▁call▁begin｜>(.*)<｜tool▁sep｜>(.*)<｜tool▁call▁end｜>", re.DOTALL)


def deepseek_sglang_layer_ids(aux_layers: Sequence[int]) -> list[int]:
    """SGLang's DeepSeek V2/V3 models (Kimi-K2.5's too) add 1 to capture ids only when the first is 1,
    and otherwise capture hidden_states[id]: auxiliary layers from index 2 go as [i - 1], others as they
    are. hidden_states[1] first cannot be asked for at all."""
    aux_layers = list(aux_layers)
    if aux_layers[0] == 1:
        raise ValueError(
            f"aux_layers {aux_layers}: SGLang's DeepSeek models cannot capture hidden_states[1] first (ids starting "
            "with 1 are shifted to 2, ids starting with 0 are taken as they are); start the list at 2 or later"
        )
    return [i - 1 for i in aux_layers] if aux_layers[0] == 2 else aux_layers


class DeepSeekToolCalls:
    """Calls as SGLang's `deepseekv31` parser (`DeepSeekV31Detector.detect_and_parse`) reads them."""

    def split(self, text: str, tools: Sequence[dict] | None, first_index: int) -> tuple[str, list[dict] | None]:
        at = text.find(CALLS_BEGIN)
        if at < 0:
            return text, None
        calls = []
        for one in ONE_CALL.findall(text):
            parts = CALL_PARTS.search(one)
            try:
                arguments = json.loads(parts[2])
            except ValueError:
                return text, []
            found = declared_call({"name": parts[1], "arguments": arguments}, tools, first_index + len(calls))
            if found is not None:
                calls.append(found)
        return (text[:at].strip(), calls) if calls else (text, [])


@register("deepseek-v3")
class DeepSeekV3(Family):
    title = "DeepSeek-V3.1 (V3.1-Terminus, V3.2-Exp): thinking switch, reasoning never rendered"
    signature = ("<｜Assistant｜>", "<｜tool▁calls▁begin｜>")
    model_types = ("deepseek_v3", "deepseek_v2")
    thinking_switch = "thinking"
    bos_in_template = True

    def tool_call_parser(self, tokenizer: PreTrainedTokenizerBase, template_kwargs: dict | None) -> DeepSeekToolCalls:
        return DeepSeekToolCalls()

    def sglang_layer_ids(self, aux_layers: Sequence[int]) -> list[int]:
        return deepseek_sglang_layer_ids(aux_layers)
