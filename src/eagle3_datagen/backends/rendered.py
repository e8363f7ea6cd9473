"""What the backends that render prompts themselves (hf, SGLang) share: the tool calls read back
from the output (the prompt itself is `chat.template.render_generation_prompt`)."""

from __future__ import annotations

from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase

from eagle3_datagen.chat.template import TemplateError
from eagle3_datagen.chat.tool_calls import ToolCallMarkers, calls_before, derive_markers


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
