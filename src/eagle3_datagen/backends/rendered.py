"""What the backends that render prompts themselves (hf, SGLang) share: the model's tokenizer and
chat template, its special tokens (read and checked, never assumed), the generation prompt's IDs,
and the generated IDs read back into a `Turn` (reasoning, content, tool calls)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from transformers import PreTrainedTokenizerBase

from eagle3_datagen.backends.base import Turn, finish_reason
from eagle3_datagen.chat.template import (
    TemplateError,
    load_tokenizer,
    render_generation_prompt,
    resolve_special_tokens,
    split_output_ids,
)
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


class RenderedChat:
    """The target model's chat as a backend that sends token IDs sees it.

    `model_settings`: the config's `model` section (`trust_remote_code`, `chat_template_kwargs`,
    `special_tokens`).
    """

    def __init__(self, model_path: str | Path, model_settings: dict):
        self.tokenizer = load_tokenizer(model_path, model_settings["trust_remote_code"])
        self.template_kwargs = model_settings["chat_template_kwargs"]
        self.specials = resolve_special_tokens(self.tokenizer, model_settings["special_tokens"], self.template_kwargs)
        self.tool_calls = ToolCallReader(self.tokenizer, self.template_kwargs)

    def prompt_ids(self, messages: list[dict], tools: list[dict] | None) -> list[int]:
        """The generation prompt's IDs (`chat.template.render_generation_prompt`), `tools` declared."""
        self.tool_calls.check(tools)
        return render_generation_prompt(self.tokenizer, messages, tools, self.template_kwargs)

    def turn(
        self,
        output_ids: list[int],
        prompt_ids: list[int],
        history: list[dict],
        tools: list[dict] | None,
        usage: dict,
        extra: dict | None = None,
    ) -> Turn:
        """The generated IDs as a turn: reasoning and content split as a reasoning parser splits
        them, calls read with the template's markers (numbered after `history`'s)."""
        parsed = split_output_ids(self.tokenizer, output_ids, self.specials, prompt_ids)
        content, calls, calls_malformed = self.tool_calls.split(parsed.content, history, tools)
        return Turn(
            content=content,
            reasoning=parsed.reasoning,
            finish_reason=finish_reason(parsed.stopped, calls),
            usage=usage,
            output_ids=output_ids,
            malformed="think_block" if not parsed.well_formed else calls_malformed,
            tool_calls=calls or None,
            extra=extra or {},
        )
