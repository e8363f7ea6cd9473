"""The model's chat as the stages use it (`load_chat`): tokenizer, family, template switches and special
tokens, checked; and the registry (`FAMILIES`) with every family module registered, which importing it does.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from eagle3_datagen.chat.families import deepseek, gpt_oss, kimi, llama, qwen3  # noqa: F401  (they register)
from eagle3_datagen.chat.families.base import (
    FAMILIES,
    GENERIC,
    Family,
    detect_family,
    family_for_model_type,
    family_named,
)
from eagle3_datagen.chat.template import (
    SpecialTokens,
    TemplateError,
    check_template_kwargs,
    load_tokenizer,
    pin_template_date,
    resolve_special_tokens,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["FAMILIES", "Family", "TargetChat", "family_for_model_type", "load_chat", "resolve_family"]


@dataclass(frozen=True)
class TargetChat:
    """A model directory's chat: what renders prompts and reads generated turns."""

    tokenizer: PreTrainedTokenizerBase
    family: Family
    template_kwargs: dict
    specials: SpecialTokens


def resolve_family(tokenizer: PreTrainedTokenizerBase, name: str) -> Family:
    """`model.family`: `auto` detects it from the chat template; a named family must match the template."""
    if name == "auto":
        return detect_family(tokenizer.chat_template)
    family = family_named(name)
    if name != GENERIC and not family.matches(tokenizer.chat_template):
        raise TemplateError(
            f"model.family is {name!r}, but the chat template lacks its signature {list(family.signature)}; "
            "set the family the template belongs to, or auto"
        )
    return family


def load_chat(model_path: str | Path, model_settings: dict) -> TargetChat:
    """The model's chat from its directory and the config's `model` section: the template date pinned,
    the switches checked against the template, the family resolved and the special tokens read and
    checked."""
    tokenizer = load_tokenizer(model_path, model_settings["trust_remote_code"])
    pin_template_date(tokenizer, model_settings["chat_template_date"], model_path)
    template_kwargs = model_settings["chat_template_kwargs"]
    check_template_kwargs(tokenizer, template_kwargs)
    family = resolve_family(tokenizer, model_settings["family"])
    specials = resolve_special_tokens(tokenizer, model_settings["special_tokens"], template_kwargs, family)
    return TargetChat(tokenizer, family, template_kwargs, specials)
