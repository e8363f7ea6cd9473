"""Llama 3.1 Instruct: header-delimited turns, JSON tool calls, no reasoning.

The template writes the BOS token itself and opens every conversation with a system turn carrying
`Cutting Knowledge Date` and `Today Date: 26 Jul 2024` (its `date_string`; not the clock). With tools,
their JSON schemas go into the first user message (`tools_in_user_message`, default true); a call is
the whole turn, `{"name": ..., "parameters": {...}}` written with `tojson`, one per turn (the template
raises on more); its result comes back in an `ipython` turn.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import TYPE_CHECKING

from eagle3_datagen.chat.families.base import Family, register
from eagle3_datagen.chat.tool_calls import declared_call

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

PYTHON_TAG = "<|python_tag|>"


class LlamaJsonToolCalls:
    """Calls as SGLang's `llama3` parser (`Llama32Detector.detect_and_parse`) reads them: JSON objects
    after `<|python_tag|>`, or a turn that starts with `{`, separated by `;`."""

    def split(self, text: str, tools: Sequence[dict] | None, first_index: int) -> tuple[str, list[dict] | None]:
        if PYTHON_TAG in text:
            content, action = text.split(PYTHON_TAG, 1)
        elif text.startswith("{"):
            content, action = "", text
        else:
            return text, None
        decoder, at, calls = json.JSONDecoder(), 0, []
        while at < len(action):
            try:
                call, end = decoder.raw_decode(action, at)
            except ValueError:
                return text, []
            found = declared_call(call, tools, first_index + len(calls)) if isinstance(call, dict) else None
            if found is not None:
                calls.append(found)
            at = end + len(";")
            while at < len(action) and action[at].isspace():
                at += 1
        return (content, calls) if calls else (text, [])


@register("llama-3.1")
class Llama31(Family):
    title = "Llama 3.1 Instruct: header turns, JSON tool calls"
    signature = ("<|start_header_id|>", "<|eot_id|>")
    model_types = ("llama",)
    tool_arguments = "object"
    parallel_tool_calls = False
    bos_in_template = True

    def tool_call_parser(self, tokenizer: PreTrainedTokenizerBase, template_kwargs: dict | None) -> LlamaJsonToolCalls:
        return LlamaJsonToolCalls()
