"""What the backends that render prompts themselves (hf, SGLang) share: the model's tokenizer and
chat template, its special tokens (read and checked, never assumed), the generation prompt's IDs,
and the generated IDs read back into a `Turn` (reasoning, content, tool calls) as the model's family
reads them (`chat.families`)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from transformers import PreTrainedTokenizerBase

from eagle3_datagen.backends.base import Turn, finish_reason
from eagle3_datagen.chat.families.base import ToolCallParser
from eagle3_datagen.chat.families.target_chat import Family, load_chat
from eagle3_datagen.chat.template import TemplateError, render_generation_prompt
from eagle3_datagen.chat.tool_calls import calls_before, openai_call


class ToolCallReader:
    """Splits a generated turn's text into content and calls, as the model's family writes them."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, template_kwargs: dict, family: Family):
        self.error = None
        self.calls_in_output = False
        try:
            self.parser: ToolCallParser | None = family.tool_call_parser(tokenizer, template_kwargs)
            self.calls_in_output = self.parser is None  # the output's own structure delimits them
        except TemplateError as e:  # a template without Kimi-style calls serves prompts without tools
            self.parser, self.error = None, e

    def check(self, tools: list[dict] | None) -> None:
        if tools and self.parser is None and not self.calls_in_output:
            raise TemplateError(f"a prompt declares tools, but {self.error}")

    def split(
        self, content: str, history: Sequence[dict], tools: list[dict] | None
    ) -> tuple[str, list[dict], str | None]:
        """(content, calls, why the turn is malformed or None); calls are numbered after `history`'s."""
        if self.parser is None:
            return content, [], None
        text, calls = self.parser.split(content, tools, calls_before(history))
        if calls is None:
            return content, [], None
        return text, calls, None if calls else "tool_calls"


class RenderedChat:
    """The target model's chat as a backend that sends token IDs sees it.

    `model_settings`: the config's `model` section (`trust_remote_code`, `chat_template_kwargs`,
    `special_tokens`).
    """

    def __init__(self, model_path: str | Path, model_settings: dict):
        chat = load_chat(model_path, model_settings)
        self.tokenizer, self.family = chat.tokenizer, chat.family
        self.template_kwargs, self.specials = chat.template_kwargs, chat.specials
        self.tool_calls = ToolCallReader(self.tokenizer, self.template_kwargs, self.family)

    def prompt_ids(self, messages: list[dict], tools: list[dict] | None) -> list[int]:
        """The generation prompt's IDs (`chat.template.render_generation_prompt`), `tools` declared."""
        self.tool_calls.check(tools)
        return render_generation_prompt(self.tokenizer, messages, tools, self.template_kwargs, self.family)

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
        them, calls read as the family writes them (numbered after `history`'s)."""
        parsed = self.family.parse_output(self.tokenizer, output_ids, self.specials, prompt_ids)
        if parsed.calls is not None:
            first = calls_before(history)
            content, calls_malformed = parsed.content, None
            calls = [openai_call(name, arguments, first + i) for i, (name, arguments) in enumerate(parsed.calls)]
        else:
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
