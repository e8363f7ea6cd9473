"""What the backends that render prompts themselves (hf, SGLang) share: the generation prompt
with the conversation's tools declared, and the tool calls read back from the output."""

from __future__ import annotations

from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase

from ..chat import TemplateError, encode, template_messages
from ..tool_calls import ToolCallMarkers, calls_before, derive_markers


def generation_prompt_ids(
    tokenizer: PreTrainedTokenizerBase, messages: Sequence[dict], tools: list[dict] | None, template_kwargs: dict
) -> list[int]:
    """The conversation rendered with the generation prompt by the tokenizer's own
    `apply_chat_template`, `tools` passed to it as a served model's chat endpoint passes them
    (so a model's remote-code tokenizer renders them its own way).

    The one place the generating backends render a prompt: it becomes
    `chat.render_generation_prompt` once the tokens stage's shared function is on main.
    """
    text = tokenizer.apply_chat_template(
        template_messages(messages),
        tools=tools or None,
        tokenize=False,
        add_generation_prompt=True,
        **template_kwargs,
    )
    return encode(tokenizer, text)


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
