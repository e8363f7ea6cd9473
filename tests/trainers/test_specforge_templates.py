"""Our tokens against SpecForge 0.2.0's own preprocessing (`specforge.data.preprocessing.preprocess_conversations`
with the chat templates it ships: qwen3-thinking, qwen3-instruct, deepseek-v3, llama3, gpt-oss), in its
venv, on the families' real tokenizers (tests/fixtures/targets) and the same conversations. The IDs agree;
where the loss masks differ, each difference is a token the model did not generate, which SpecForge trains:
the newline Qwen3's template writes after `<|im_end|>` (generation stops at `<|im_end|>`), the
`<think>\\n` and `</think>` the generation prompt already holds, and gpt-oss's tool result (with the
next generation prompt). Two SpecForge
defects are pinned too: DeepSeek-V3.1's tool calls (it parses `arguments` into an object, which V3.1's
template cannot concatenate, and falls back to a rendering without the calls and results), and its
transformers 5.8.1 loading DeepSeek-V3.1's tokenizer as a sentencepiece Llama tokenizer that drops spaces
(`chat.template.load_tokenizer` reads it as its tokenizer.json says)."""

import json

import pytest
from specforge.data.preprocessing import preprocess_conversations
from specforge.data.template import TEMPLATE_REGISTRY

from eagle3_datagen.stages.tokens import TokenBuilder, loss_spans
from tests.helpers import TARGET_FILES, target_chat, token_settings
from tests.helpers.families import SYSTEM, WEATHER

CALL = {
    "id": "functions.get_weather:0",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
}


def reply(content, reasoning="", **extra):
    return {"role": "assistant", "content": content, "reasoning": reasoning, "finish_reason": "stop", **extra}


def two_turns(reasoning=("", "")):
    return [SYSTEM, {"role": "user", "content": "What is 2+2?"}, reply("4.", reasoning[0]),
            {"role": "user", "content": "And 3+3?"}, reply("6.", reasoning[1])]  # fmt: skip


CHAIN = [
    SYSTEM,
    {"role": "user", "content": "Weather in Paris?"},
    reply("", tool_calls=[CALL], finish_reason="tool_calls"),
    {"role": "tool", "tool_call_id": CALL["id"], "name": "get_weather", "content": '{"temp_c": 21}'},
    reply("It is 21C."),
]


def ours(chat, messages, tools=None) -> dict:
    builder = TokenBuilder(chat.tokenizer, chat.specials, token_settings(), chat.template_kwargs, family=chat.family)
    [sample] = builder.samples_for({"id": "s", "status": "ok", "messages": messages, "tools": tools})
    return sample


def specforge(chat, template, messages, tools=None) -> dict:
    """SpecForge's preprocessing of the same conversation (its ShareGPT-style message fields; gpt-oss's
    harmony parser takes the template's rendering preformatted: it would otherwise write its own)."""
    if template == "gpt-oss":
        rendered = chat.family.template_messages(messages)
        source = chat.tokenizer.apply_chat_template(rendered, tools=tools, tokenize=False)
    else:
        source = []
        for message in messages:
            keep = {k: v for k, v in message.items() if k in ("role", "content", "tool_calls", "tool_call_id", "name")}
            if message.get("reasoning"):
                keep["reasoning_content"] = message["reasoning"]
            source.append(keep)
    out = preprocess_conversations(
        chat.tokenizer,
        [source],
        TEMPLATE_REGISTRY.get(template),
        max_length=4096,
        is_preformatted=template == "gpt-oss",
        tools=[tools or []],
    )
    return {"input_ids": out["input_ids"][0][0].tolist(), "loss_mask": out["loss_mask"][0][0].tolist()}


def only_specforge_trains(chat, sample, theirs) -> list[str]:
    """The token runs SpecForge trains and we do not (we train none it does not)."""
    ours_mask, their_mask = sample["loss_mask"], theirs["loss_mask"][: len(sample["loss_mask"])]
    assert not any(o and not t for o, t in zip(ours_mask, their_mask, strict=True))
    extra = [int(t and not o) for o, t in zip(ours_mask, their_mask, strict=True)]
    return [chat.tokenizer.decode(run) for run in loss_spans(sample["input_ids"], extra)]


NEWLINE = 198  # Qwen3's "\n", which its template writes after the conversation's last <|im_end|>

CASES = [
    # (fixture folder, chat_template_kwargs, SpecForge template, conversation, tools, what only SpecForge trains)
    ("qwen3", {}, "qwen3-thinking", two_turns(("Add.", "Add again.")), None, ["\n", "<think>\n"]),
    ("qwen3-hybrid", {}, "qwen3-thinking", two_turns(("Add.", "Add again.")), None, ["\n"]),
    ("qwen3-hybrid", {"enable_thinking": False}, "qwen3-instruct", two_turns(), None, ["\n"]),
    ("qwen3-hybrid", {}, "qwen3-thinking", CHAIN, WEATHER, ["\n"]),
    ("deepseek-v3", {}, "deepseek-v3", two_turns(), None, ["</think>", "</think>"]),
    ("llama-3.1", {}, "llama3", two_turns(), None, []),
    ("llama-3.1", {}, "llama3", CHAIN, WEATHER, []),
    ("gpt-oss", {}, "gpt-oss", two_turns(("Add.", "Add again.")), None, []),
    (
        "gpt-oss",
        {},
        "gpt-oss",
        CHAIN,
        WEATHER,
        # the tool result and the answer's generation prompt, both context
        [
            '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"{\\"temp_c\\": 21}"<|end|>'
            "<|start|>assistant"
        ],
    ),
]


@pytest.mark.parametrize(("folder", "kwargs", "template", "messages", "tools", "extra"), CASES)
def test_specforges_preprocessing_agrees_but_for_what_the_model_did_not_generate(
    folder, kwargs, template, messages, tools, extra
):
    chat = target_chat(folder, chat_template_kwargs=kwargs)
    sample, theirs = ours(chat, messages, tools), specforge(chat, template, messages, tools)
    qwen = folder.startswith("qwen3")
    assert theirs["input_ids"] == sample["input_ids"] + ([NEWLINE] if qwen else [])
    # (beyond our sample, SpecForge also trains the newline after the last <|im_end|>)
    assert only_specforge_trains(chat, sample, theirs) == extra


def test_qwen3_differences_are_the_newline_after_each_turn_and_the_prompts_think():
    """Spelled out on one case: per trained turn, SpecForge adds the newline after <|im_end|>; with the 2507
    Thinking template also the <think>\\n of the last turn's generation prompt."""
    chat = target_chat("qwen3")
    messages = two_turns(("Add.", "Add again."))
    sample, theirs = ours(chat, messages), specforge(chat, "qwen3-thinking", messages)
    theirs_trained = [chat.tokenizer.decode(s) for s in loss_spans(theirs["input_ids"], theirs["loss_mask"])]
    assert [chat.tokenizer.decode(s) for s in loss_spans(sample["input_ids"], sample["loss_mask"])] == [
        "4.<|im_end|>",
        "Add again.\n</think>\n\n6.<|im_end|>",
    ]
    assert theirs_trained == ["4.<|im_end|>\n", "<think>\nAdd again.\n</think>\n\n6.<|im_end|>\n"]


def test_specforge_drops_deepseek_v31_tool_calls_that_our_tokens_keep():
    chat = target_chat("deepseek-v3")
    sample, theirs = ours(chat, CHAIN, WEATHER), specforge(chat, "deepseek-v3", CHAIN, WEATHER)
    ours_text, their_text = chat.tokenizer.decode(sample["input_ids"]), chat.tokenizer.decode(theirs["input_ids"])
    assert "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>" in ours_text
    assert "<｜tool▁output▁begin｜>" in ours_text
    assert "tool▁call" not in their_text and "temp_c" not in their_text  # its fallback rendering


def test_specforges_transformers_misreads_deepseek_v31s_tokenizer():
    from transformers import AutoTokenizer

    text = "Hello world, ünïcode"
    pinned = AutoTokenizer.from_pretrained(TARGET_FILES / "deepseek-v3")
    assert type(pinned).__name__ == "LlamaTokenizer"
    assert pinned.decode(pinned(text, add_special_tokens=False)["input_ids"]) == "Helloworld,ünïcode"
    ours_tokenizer = target_chat("deepseek-v3").tokenizer
    assert ours_tokenizer.decode(ours_tokenizer(text, add_special_tokens=False)["input_ids"]) == text
    assert json.loads((TARGET_FILES / "deepseek-v3/tokenizer_config.json").read_text())["tokenizer_class"] == (
        "LlamaTokenizerFast"
    )
