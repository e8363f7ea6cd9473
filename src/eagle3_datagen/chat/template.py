"""The target model's tokenizer and chat template: loading, special tokens, rendering.

Special-token IDs are read from the tokenizer and checked, never assumed: the end-of-turn
token is the special token the chat template itself places after an assistant turn.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from datetime import date
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple, Protocol

from eagle3_datagen.config_schema import fill_defaults

# transformers (and the torch it imports, seconds of CPU) where a tokenizer is loaded: the jobs that import
# the chat modules without one (export, release) start without it.
if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class FamilyRendering(Protocol):
    """What rendering reads of a target family (`chat.families`, whose entries build on this module): the
    message layout its template takes and the tokens that end its turns."""

    turn_ends: tuple[str, ...]
    stop_tokens: tuple[str, ...]

    def template_messages(self, messages: Sequence[dict]) -> list[dict]: ...


PROBE_USER = "Say hi."
PROBE_ASSISTANT = "Probe reply."


class TemplateError(ValueError):
    """The tokenizer or chat template does not behave as the tokens stage requires."""


@dataclass(frozen=True)
class SpecialTokens:
    end_of_turn: str
    end_of_turn_id: int
    think_start: str | None
    think_start_id: int | None
    think_end: str | None
    think_end_id: int | None
    # Every special token the template renders in a conversation (role headers, separators).
    template_tokens: dict[str, int] = field(default_factory=dict)
    # The family's other tokens that end a turn in a rendered history (gpt-oss: <|end|>, <|call|>), and
    # those that end generation beside the end-of-turn token (a tool call's own end).
    turn_ends: dict[str, int] = field(default_factory=dict)
    stop_tokens: dict[str, int] = field(default_factory=dict)
    # Other special (control) tokens: a turn that contains one is not a well-formed answer.
    control_ids: frozenset[int] = field(default=frozenset(), repr=False)

    @property
    def stop_ids(self) -> list[int]:
        """Every token that ends generation: the end-of-turn token first."""
        return [self.end_of_turn_id, *(i for i in self.stop_tokens.values() if i != self.end_of_turn_id)]

    def as_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k != "control_ids"}


def load_tokenizer(model_path: str | Path, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(
        str(model_path), trust_remote_code=trust_remote_code, local_files_only=True
    )
    if not tokenizer.chat_template:
        raise TemplateError(f"{model_path}: the tokenizer has no chat template; add one to tokenizer_config.json")
    return as_its_file_says(tokenizer, model_path)


# Text whose encoding differs when a tokenizer's pre-tokenizer is not its tokenizer.json's.
PIPELINE_PROBE = "Hello world, ünïcode 你好\n  x = 1"


def as_its_file_says(tokenizer: PreTrainedTokenizerBase, model_path: str | Path) -> PreTrainedTokenizerBase:
    """The tokenizer as its `tokenizer.json` defines it. transformers 5.8 to 5.19 (SpecForge's and SGLang's
    pins) load DeepSeek-V3.1's byte-level tokenizer.json, whose config names `LlamaTokenizerFast`, as a
    sentencepiece `LlamaTokenizer` that drops spaces ("Hello world" -> other IDs); 5.23 loads it as the file
    says. A model-specific class whose encoding differs from the file's is replaced by the file's own."""
    from transformers import PreTrainedTokenizerFast

    file = Path(model_path) / "tokenizer.json"
    if not tokenizer.is_fast or type(tokenizer) is PreTrainedTokenizerFast or not file.is_file():
        return tokenizer
    from tokenizers import Tokenizer

    expected = Tokenizer.from_file(str(file)).encode(PIPELINE_PROBE, add_special_tokens=False).ids
    if tokenizer(PIPELINE_PROBE, add_special_tokens=False)["input_ids"] == expected:
        return tokenizer
    return PreTrainedTokenizerFast.from_pretrained(str(model_path), local_files_only=True)


# transformers' templates read the clock through one global function, `strftime_now(format)`.
CLOCK_CALL = re.compile(r"""strftime_now\(\s*(["'])(?P<format>[^"']*)\1\s*\)""")


def pin_template_date(tokenizer: PreTrainedTokenizerBase, template_date: str | None, where: object = "") -> None:
    """Make a chat template that writes today's date (gpt-oss's system message: `Current date: ...`)
    write `template_date` (YYYY-MM-DD) instead, so that the responses and tokens stages, run on
    different days, render the same prompt. Each `strftime_now("FORMAT")` call becomes the date so
    formatted; a template that reads the clock otherwise, or without a date configured, is refused."""
    template = tokenizer.chat_template
    if "strftime_now" not in template:
        return
    if template_date is None:
        raise TemplateError(
            f"{where}: the chat template writes today's date (strftime_now), so prompts rendered on another day "
            "differ from those the model saw; set model.chat_template_date (YYYY-MM-DD) to fix the date"
        )
    day = date.fromisoformat(template_date)
    pinned = CLOCK_CALL.sub(lambda call: json.dumps(day.strftime(call["format"])), template)
    if "strftime_now" in pinned:
        raise TemplateError(f"{where}: the chat template calls strftime_now in a form that cannot be pinned")
    tokenizer.chat_template = pinned


def template_variables(tokenizer: PreTrainedTokenizerBase) -> set[str]:
    """The variables the chat template reads from its caller (messages, tools, its switches)."""
    from jinja2 import meta
    from transformers.utils.chat_template_utils import _compile_jinja_template

    environment = _compile_jinja_template(tokenizer.chat_template).environment
    return meta.find_undeclared_variables(environment.parse(tokenizer.chat_template))


def check_template_kwargs(tokenizer: PreTrainedTokenizerBase, template_kwargs: dict | None) -> None:
    """Every `model.chat_template_kwargs` key must be a variable the template reads: a switch it does
    not know (`enable_thinking` for DeepSeek-V3.1, whose switch is `thinking`) would be ignored silently."""
    unknown = sorted(set(template_kwargs or {}) - template_variables(tokenizer))
    if unknown:
        raise TemplateError(
            f"model.chat_template_kwargs sets {unknown}, which the chat template never reads (it reads "
            f"{sorted(template_variables(tokenizer) - {'messages', 'tools', 'add_generation_prompt'})}); "
            "a switch the template does not know changes nothing: use the template's own name for it"
        )


TEMPLATE_FIELDS = ("tool_calls", "tool_call_id", "name")


def template_messages(
    messages: Sequence[dict],
    reasoning_field: str = "reasoning_content",
    reasoning_when_empty: bool = True,
    object_arguments: bool = False,
) -> list[dict]:
    """Our message rows -> the dicts chat templates expect: reasoning under `reasoning_field` (empty
    too, unless `reasoning_when_empty` is false), tool-call arguments as their JSON string or, with
    `object_arguments`, as the object it holds (templates that write them with `tojson`)."""
    out = []
    for message in messages:
        item = {"role": message["role"], "content": message["content"]}
        if message["role"] == "assistant" and (message.get("reasoning") or reasoning_when_empty):
            item[reasoning_field] = message.get("reasoning") or ""
        item.update({k: message[k] for k in TEMPLATE_FIELDS if message.get(k)})
        if object_arguments and item.get("tool_calls"):
            item["tool_calls"] = [_object_arguments(call) for call in item["tool_calls"]]
        out.append(item)
    return out


def _object_arguments(call: dict) -> dict:
    arguments = call["function"]["arguments"]
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            raise TemplateError(
                f"tool call {call.get('id')}: its arguments are not JSON ({arguments[:100]!r}), and this chat "
                "template renders arguments from the object they hold"
            ) from None
    return {**call, "function": {**call["function"], "arguments": arguments}}


def render_text(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[dict],
    add_generation_prompt: bool,
    template_kwargs: dict | None = None,
    tools: Sequence[dict] | None = None,
    family: FamilyRendering | None = None,
) -> str:
    """`messages` rendered by the tokenizer's chat template, `tools` (OpenAI layout) declared to it,
    in the message layout `family`'s template reads (None: the generic layout).

    The tokenizer's own `apply_chat_template` renders them, so a model's remote-code tokenizer
    can hand the template its own rendering of the tools (Kimi-K2.5's TypeScript `tools_ts_str`).
    """
    return tokenizer.apply_chat_template(
        family.template_messages(messages) if family else template_messages(messages),
        tools=list(tools) if tools else None,
        tokenize=False,
        add_generation_prompt=add_generation_prompt,
        **(template_kwargs or {}),
    )


PROBE_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "probe",
            "description": "Probe.",
            "parameters": {"type": "object", "properties": {"x": {"type": "string"}}, "required": ["x"]},
        },
    }
]


def tools_rendering(tokenizer: PreTrainedTokenizerBase, template_kwargs: dict | None = None) -> str:
    """Who renders tool declarations: `tokenizer` when the tokenizer's own `apply_chat_template`
    hands the template its own rendering (Kimi-K2.5's remote-code tokenizer: TypeScript
    `tools_ts_str`), `template` when the template renders the `tools` list itself (K2.5's
    template then falls back to compact JSON), `ignored` when nobody does (DeepSeek-V3.1's template:
    the declarations belong in the system prompt)."""
    from transformers import PreTrainedTokenizerBase

    messages = template_messages([{"role": "user", "content": PROBE_USER}])
    kwargs = {"tokenize": False, "add_generation_prompt": True, **(template_kwargs or {})}
    own = tokenizer.apply_chat_template(messages, tools=PROBE_TOOLS, **kwargs)
    if own == tokenizer.apply_chat_template(messages, **kwargs):
        return "ignored"
    plain = PreTrainedTokenizerBase.apply_chat_template(tokenizer, messages, tools=PROBE_TOOLS, **kwargs)
    return "template" if own == plain else "tokenizer"


def encode(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """Encode a whole rendered string at once; special tokens in it map to their IDs."""
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def render_ids(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[dict],
    add_generation_prompt: bool,
    template_kwargs: dict | None = None,
    tools: Sequence[dict] | None = None,
    family: FamilyRendering | None = None,
) -> list[int]:
    return encode(tokenizer, render_text(tokenizer, messages, add_generation_prompt, template_kwargs, tools, family))


def render_generation_prompt(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[dict],
    tools: Sequence[dict] | None = None,
    template_kwargs: dict | None = None,
    family: FamilyRendering | None = None,
) -> list[int]:
    """The input IDs a served model sees before it generates the next assistant turn.

    `messages`: the conversation so far in the project's row layout (assistant `reasoning`,
    OpenAI `tool_calls` and `tool` messages); `tools`: the record's OpenAI-layout declarations
    or None. Rendered with the generation prompt by the tokenizer's own `apply_chat_template`
    (so Kimi-K2.5's tokenizer declares the tools as TypeScript, one built from its files alone as
    the template's JSON) and encoded whole. The tokens stage trains each turn on exactly these
    IDs followed by what the model produced.
    """
    return render_ids(tokenizer, messages, True, template_kwargs, tools, family)


def single_token_id(tokenizer: PreTrainedTokenizerBase, token: str) -> int:
    """The one ID `token` encodes to, checked to decode back to the same string."""
    ids = encode(tokenizer, token)
    if len(ids) != 1:
        raise TemplateError(
            f"special token {token!r} encodes to {len(ids)} IDs {ids}, not one: it is not in this "
            "tokenizer's vocabulary as an added token; check model.special_tokens in the config"
        )
    decoded = tokenizer.decode(ids, skip_special_tokens=False)
    if decoded != token:
        raise TemplateError(f"special token {token!r} (ID {ids[0]}) decodes to {decoded!r}")
    return ids[0]


def _special_ids(tokenizer: PreTrainedTokenizerBase) -> set[int]:
    return {token_id for token_id, added in tokenizer.added_tokens_decoder.items() if added.special}


def turn_start(prompt: str, full: str, think_start: str | None, think_end: str | None) -> int | None:
    """Where the last turn starts in `full`, a conversation's rendering that ends with it, when `full`
    continues `prompt`, its generation prompt: after the prompt, or where a prompt that opened a
    think block continues with the block closed (DeepSeek-V3.1 renders every turn `</think>{answer}`,
    its reasoning never: the model wrote it before that `</think>`). None where it does neither."""
    if full.startswith(prompt):
        return len(prompt)
    if think_start and think_end and prompt.endswith(think_start):
        opened_at = len(prompt) - len(think_start)
        if full.startswith(think_end, opened_at) and full.startswith(prompt[:opened_at]):
            return opened_at
    return None


def detect_end_of_turn(
    tokenizer: PreTrainedTokenizerBase,
    template_kwargs: dict | None = None,
    family: FamilyRendering | None = None,
    think: tuple[str | None, str | None] = (None, None),
) -> str:
    """The first special token that the template renders after an assistant turn's content."""
    probe = [{"role": "user", "content": PROBE_USER}]
    prefix = render_text(tokenizer, probe, True, template_kwargs, family=family)
    answer = {"role": "assistant", "content": PROBE_ASSISTANT}
    full = render_text(tokenizer, [*probe, answer], False, template_kwargs, family=family)
    start = turn_start(prefix, full, *think)
    if start is None:
        raise TemplateError("the chat template is not prefix-stable for a one-turn conversation")
    turn = full[start:]
    after_content = turn[turn.rindex(PROBE_ASSISTANT) + len(PROBE_ASSISTANT) :]
    special = _special_ids(tokenizer)
    for token_id in encode(tokenizer, after_content):
        if token_id in special:
            return tokenizer.convert_ids_to_tokens(token_id)
    raise TemplateError(
        "the chat template puts no special token after an assistant turn; "
        "set model.special_tokens.end_of_turn in the config"
    )


def template_special_tokens(
    tokenizer: PreTrainedTokenizerBase, template_kwargs: dict | None = None, family: FamilyRendering | None = None
) -> list[str]:
    """The special tokens a rendered system/user/assistant exchange contains, in first-seen order."""
    probe = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": PROBE_USER},
        {"role": "assistant", "content": PROBE_ASSISTANT},
    ]
    special = _special_ids(tokenizer)
    ids = render_ids(tokenizer, probe, False, template_kwargs, family=family)
    ids += render_ids(tokenizer, probe[:2], True, template_kwargs, family=family)
    return list(dict.fromkeys(tokenizer.convert_ids_to_tokens(i) for i in ids if i in special))


def resolve_special_tokens(
    tokenizer: PreTrainedTokenizerBase,
    configured: dict | None = None,
    template_kwargs: dict | None = None,
    family: FamilyRendering | None = None,
) -> SpecialTokens:
    """Resolve end-of-turn, template and thinking tokens to IDs, each checked to round-trip.

    `configured` (`model.special_tokens`; what it leaves out takes the schema's default) may name the
    end-of-turn token (else it is read from the template; when named, it must be the one the template
    places) and pin IDs (`expected_ids`), which must match. `family` adds the tokens its entry names
    (turn ends in a history, further stop tokens).
    """
    configured = fill_defaults(dict(configured or {}), "model.special_tokens")
    vocab = tokenizer.get_vocab()
    think_start, think_end = configured["think_start"], configured["think_end"]
    has_thinking = think_start in vocab and think_end in vocab
    think = (think_start, think_end) if has_thinking else (None, None)
    detected = detect_end_of_turn(tokenizer, template_kwargs, family, think)
    end_of_turn = configured["end_of_turn"]
    if end_of_turn == "auto":
        end_of_turn = detected
    elif end_of_turn != detected:
        single_token_id(tokenizer, end_of_turn)  # a token outside the vocabulary gets that message first
        raise TemplateError(
            f"model.special_tokens.end_of_turn is {end_of_turn!r}, but the chat template ends an assistant turn "
            f"with {detected!r}; set it to {detected!r} or to auto"
        )
    template_tokens = {
        t: single_token_id(tokenizer, t) for t in template_special_tokens(tokenizer, template_kwargs, family)
    }
    turn_ends = {t: single_token_id(tokenizer, t) for t in (family.turn_ends if family else ())}
    stop_tokens = {t: single_token_id(tokenizer, t) for t in (family.stop_tokens if family else ())}
    end_of_turn_id = single_token_id(tokenizer, end_of_turn)
    for token, expected in (configured.get("expected_ids") or {}).items():
        actual = single_token_id(tokenizer, token)
        if actual != expected:
            raise TemplateError(
                f"model.special_tokens.expected_ids says {token!r} is {expected}, but this tokenizer maps it to "
                f"{actual}: the config and the model directory disagree; fix the config or model.path"
            )
    return SpecialTokens(
        end_of_turn=end_of_turn,
        end_of_turn_id=end_of_turn_id,
        think_start=think_start if has_thinking else None,
        think_start_id=single_token_id(tokenizer, think_start) if has_thinking else None,
        think_end=think_end if has_thinking else None,
        think_end_id=single_token_id(tokenizer, think_end) if has_thinking else None,
        template_tokens=template_tokens,
        turn_ends=turn_ends,
        stop_tokens=stop_tokens,
        control_ids=frozenset(_special_ids(tokenizer) - {end_of_turn_id, *stop_tokens.values()}),
    )


class ParsedOutput(NamedTuple):
    reasoning: str
    content: str
    stopped: bool  # ended with a stop token
    well_formed: bool  # at most one closed think block, at the start; no control tokens
    # (name, arguments) of the calls the output's own structure delimits (harmony's commentary messages);
    # None where calls are written in the content, for the family's tool-call parser to read.
    calls: list[tuple[str, str]] | None = None


def split_output_ids(
    tokenizer: PreTrainedTokenizerBase,
    output_ids: Sequence[int],
    specials: SpecialTokens,
    prompt_ids: Sequence[int] = (),
) -> ParsedOutput:
    """Generated IDs -> reasoning and content, the way a reasoning parser splits them.

    The generation prompt may already open a think block (the output's reasoning then runs to
    `</think>`) or close an empty one (the output must then have no think tokens at all).
    Whitespace around the think block is trimmed the way chat templates re-add it. An output
    with an unclosed or repeated think block, or a control token inside the turn, cannot be
    rendered back by the template and is reported as not well formed.
    """
    ids = list(output_ids)
    stopped = bool(ids) and ids[-1] in specials.stop_ids
    if stopped:
        ids = ids[:-1]
    think = {specials.think_start_id, specials.think_end_id} - {None}
    header = list(prompt_ids)
    if specials.end_of_turn_id in header:  # only the current assistant header matters
        header = header[len(header) - header[::-1].index(specials.end_of_turn_id) :]
    prompt_think = [t for t in header if t in think]
    opened_by_prompt = prompt_think[-1:] == [specials.think_start_id]
    closed_by_prompt = prompt_think[-1:] == [specials.think_end_id]
    reasoning, thought = "", []
    has_think_block = not closed_by_prompt and specials.think_end_id in ids
    if has_think_block:
        cut = ids.index(specials.think_end_id)
        thought, ids = ids[:cut], ids[cut + 1 :]
        if thought and thought[0] == specials.think_start_id and not opened_by_prompt:
            thought = thought[1:]
        reasoning = tokenizer.decode(thought, skip_special_tokens=False).strip("\n")
    unclosed = opened_by_prompt and not has_think_block
    well_formed = not unclosed and not (think | specials.control_ids).intersection(thought + ids)
    content = tokenizer.decode(ids, skip_special_tokens=False)
    return ParsedOutput(reasoning, content.lstrip("\n") if has_think_block else content, stopped, well_formed)
