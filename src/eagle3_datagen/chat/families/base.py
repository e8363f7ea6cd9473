"""What a target family's chat template and architecture need beyond what the template says itself.

Most of the tokens stage reads the template (`chat.template`: the end-of-turn token, the special
tokens, the turn boundaries, the model's format); an entry of `FAMILIES` names only what differs and
cannot be read off a rendering: the message field the template reads reasoning from, whether tool-call
arguments go in as a JSON string or an object, the tokens that end a turn in a history, the tokens that
stop generation, how a generated turn and its tool calls are read back, and how SGLang numbers the
auxiliary layers of the family's architectures. `Family` itself is the generic entry: a template it
cannot name is handled as the template renders it, with Kimi-K2.5's tool-call layout derived from it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar, Protocol

from eagle3_datagen.chat.template import ParsedOutput, SpecialTokens, split_output_ids, template_messages
from eagle3_datagen.chat.tool_calls import derive_markers
from eagle3_datagen.registry import Registry

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

FAMILIES: Registry[type[Family]] = Registry("target family")
GENERIC = "generic"


def register(name: str):
    """Register a `Family` subclass under `name` (the config's `model.family`)."""

    def add(cls: type[Family]) -> type[Family]:
        cls.name = name
        return FAMILIES.register(name)(cls)

    return add


class ToolCallParser(Protocol):
    """A generated turn's text -> (content, calls): calls None where the text holds no call section,
    [] where it holds one that cannot be read. Calls get Kimi-style ids numbered from `first_index`."""

    def split(self, text: str, tools: Sequence[dict] | None, first_index: int) -> tuple[str, list[dict] | None]: ...


@register(GENERIC)
class Family:
    """A family's entry; this base class is the generic one (the template alone says everything)."""

    name: ClassVar[str]
    title: ClassVar[str] = "any other chat template: everything read off its renderings"
    # Detection: a chat template that contains every one of these strings is the family's.
    signature: ClassVar[tuple[str, ...]] = ()
    # config.json `model_type`s of the family's architectures (their SGLang layer numbering).
    model_types: ClassVar[tuple[str, ...]] = ()
    # The chat_template_kwargs key the template reads to switch reasoning (or set its effort); None: none.
    thinking_switch: ClassVar[str | None] = None
    # The assistant message field the template reads reasoning from, and whether an empty one is passed
    # (gpt-oss renders an analysis message whenever the key is there).
    reasoning_field: ClassVar[str] = "reasoning_content"
    reasoning_when_empty: ClassVar[bool] = True
    # How the template wants tool-call arguments: "string" (the JSON text as generated) or "object".
    tool_arguments: ClassVar[str] = "string"
    # Whether the template renders several calls in one assistant turn (else the tokens stage refuses them).
    parallel_tool_calls: ClassVar[bool] = True
    # Special tokens that end an assistant turn where the template renders it in a history, beside the
    # end-of-turn token; after one of them, `turn_continues` (harmony: another assistant message) goes on.
    turn_ends: ClassVar[tuple[str, ...]] = ()
    turn_continues: ClassVar[str | None] = None
    # Tokens that end generation beside the end-of-turn token (a tool call's own end).
    stop_tokens: ClassVar[tuple[str, ...]] = ()
    # The template writes the BOS token itself (so rendered text is encoded without adding another).
    bos_in_template: ClassVar[bool] = False

    @classmethod
    def matches(cls, template: str) -> bool:
        return bool(cls.signature) and all(s in template for s in cls.signature)

    def template_messages(self, messages: Sequence[dict]) -> list[dict]:
        """Our message rows -> the dicts this family's template reads."""
        return template_messages(
            messages,
            reasoning_field=self.reasoning_field,
            reasoning_when_empty=self.reasoning_when_empty,
            object_arguments=self.tool_arguments == "object",
        )

    def tool_call_parser(
        self, tokenizer: PreTrainedTokenizerBase, template_kwargs: dict | None
    ) -> ToolCallParser | None:
        """How a generated turn's tool calls are read; generic: Kimi's layout, markers read off the template."""
        return derive_markers(tokenizer, template_kwargs, self)

    def parse_output(
        self,
        tokenizer: PreTrainedTokenizerBase,
        output_ids: Sequence[int],
        specials: SpecialTokens,
        prompt_ids: Sequence[int] = (),
    ) -> ParsedOutput:
        """Generated IDs -> reasoning, content (tool calls in it), stopped, well formed: a think block."""
        return split_output_ids(tokenizer, output_ids, specials, prompt_ids)

    def sglang_layer_ids(self, aux_layers: Sequence[int]) -> list[int]:
        """The ids SGLang's `set_eagle3_layers_to_capture` (and a served draft's
        `eagle_aux_hidden_state_layer_ids`) must get to capture hidden_states `aux_layers`: for most
        architectures it captures the input of layer id + 1, i.e. hidden_states[id + 1]."""
        return [i - 1 for i in aux_layers]


def family_named(name: str) -> Family:
    return FAMILIES[name]()


def detect_family(template: str) -> Family:
    """The family whose signature the chat template carries; the generic one where none does."""
    found = [cls for _, cls in FAMILIES.items() if cls.matches(template)]
    if len(found) > 1:
        raise ValueError(f"the chat template matches several families: {[c.name for c in found]}; set model.family")
    return found[0]() if found else Family()


def family_for_model_type(model_type: str) -> Family:
    """The family whose architectures include `model_type` (the generic one where none does)."""
    for _, cls in FAMILIES.items():
        if model_type in cls.model_types:
            return cls()
    return Family()
