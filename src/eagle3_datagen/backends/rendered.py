"""What the backends that render prompts themselves (hf, SGLang) share: the generation prompt
with the conversation's tools declared, and the tool calls read back from the output."""

from __future__ import annotations

from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase

from ..chat import TemplateError, render_ids
from ..tool_calls import ToolCallMarkers, calls_before, derive_markers


def generation_prompt_ids(
    tokenizer: PreTrainedTokenizerBase, messages: Sequence[dict], tools: list[dict] | None, template_kwargs: dict
) -> list[int]:
    """The conversation rendered by the model's template with the generation prompt, `tools` passed
    to the template as a served model's chat endpoint passes them."""
    return render_ids(tokenizer, messages, True, {**template_kwargs, "tools": tools} if tools else template_kwargs)


class ToolCallReader:
    """Splits a generated turn's text into content and calls with the template's own markers."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, template_kwargs: dict):
        try:
            self.markers: ToolCallMarkers | None = derive_markers(tokenizer, template_kwargs)
            self.error = None
        except TemplateError as e:  # a template without Kimi-style calls serves prompts without tools
            self.markers, self.error = None, e

    def check(self, tools: list[dict] | None) -> None:
        if tools and self.markers is None:
            raise TemplateError(f"a prompt declares tools, but {self.error}")

    def split(
        self, content: str, history: Sequence[dict], tools: list[dict] | None
    ) -> tuple[str, list[dict], str | None]:
        """(content, calls, why the turn is malformed or None); calls are numbered after `history`'s."""
        if self.markers is None:
            return content, [], None
        text, calls = self.markers.split(content, tools, calls_before(history))
        if calls is None:
            return content, [], None
        return text, calls, None if calls else "tool_calls"
