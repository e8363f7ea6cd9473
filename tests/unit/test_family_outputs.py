"""Generated turns read back as each family writes them (the hf and SGLang backends' `RenderedChat`), on
the real tokenizers of tests/fixtures/targets: reasoning, content and tool calls as SGLang's own parsers
split them (qwen25, deepseekv31, llama3, gpt-oss; read in SGLang 0.5.23's source), and the turn, fed
to the tokens stage as text, rebuilt to the very IDs generated. Also the registry itself and SGLang's
layer numbering per family."""

import json

import pytest

from eagle3_datagen.backends.rendered import RenderedChat
from eagle3_datagen.chat.families.deepseek import deepseek_sglang_layer_ids
from eagle3_datagen.chat.families.target_chat import FAMILIES, family_for_model_type
from eagle3_datagen.chat.template import encode
from eagle3_datagen.registry import Registry, UnknownEntry
from eagle3_datagen.stages.tokens import TokenBuilder, loss_spans
from tests.helpers import TARGET_FILES, TEMPLATE_DATE, defaults, token_settings

# (gpt-oss's template needs a description: it writes `// {description}` unguarded)
WEATHER = [{"type": "function", "function": {"name": "get_weather", "description": "Weather.", "parameters": {}}}]
ASK = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def chats():
    loaded = {}

    def chat(folder, **kwargs):
        key = (folder, json.dumps(kwargs))
        if key not in loaded:
            model = defaults(
                "model", path=str(TARGET_FILES / folder), chat_template_date=TEMPLATE_DATE, chat_template_kwargs=kwargs
            )
            loaded[key] = RenderedChat(TARGET_FILES / folder, model)
        return loaded[key]

    return chat


def read(chat, emitted: str, history=ASK, tools=WEATHER):
    prompt = chat.prompt_ids(history, tools)
    output = encode(chat.tokenizer, emitted)
    return chat.turn(output, prompt, history, tools, {"completion_tokens": len(output)}), output


def rebuilt(chat, history, turn, output, tools=WEATHER) -> list[int]:
    """The tokens stage's IDs for the turn from its text (no output_ids): its last trained span."""
    builder = TokenBuilder(chat.tokenizer, chat.specials, token_settings(), chat.template_kwargs, family=chat.family)
    message = turn.as_message(0)
    message.pop("output_ids")
    [sample] = builder.samples_for({"id": "s", "status": "ok", "tools": tools, "messages": [*history, message]})
    return loss_spans(sample["input_ids"], sample["loss_mask"])[-1]


PARIS = '{"city": "Paris"}'
CALL_TEXTS = {
    "qwen3": "Let me check.\n</think>\n\n<tool_call>\n"
    f'{{"name": "get_weather", "arguments": {PARIS}}}\n</tool_call><|im_end|>',
    "deepseek-v3": f"<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{PARIS}<｜tool▁call▁end｜>"
    "<｜tool▁calls▁end｜><｜end▁of▁sentence｜>",
    "llama-3.1": f'{{"name": "get_weather", "parameters": {PARIS}}}<|eot_id|>',
    "gpt-oss": "<|channel|>analysis<|message|>Let me check.<|end|><|start|>assistant to=functions.get_weather"
    f"<|channel|>commentary json<|message|>{PARIS}<|call|>",
}


@pytest.mark.parametrize("folder", CALL_TEXTS)
def test_a_generated_call_is_read_as_sglang_reads_it_and_rebuilds_to_its_ids(chats, folder):
    chat = chats(folder)
    turn, output = read(chat, CALL_TEXTS[folder])
    assert turn.finish_reason == "tool_calls" and turn.malformed is None and turn.content == ""
    assert turn.tool_calls == [
        {"id": "functions.get_weather:0", "type": "function", "function": {"name": "get_weather", "arguments": PARIS}}
    ]
    assert turn.reasoning == ("Let me check." if folder in ("qwen3", "gpt-oss") else "")
    assert rebuilt(chat, ASK, turn, output) == output


ANSWERS = {
    "qwen3": "I will answer.\n</think>\n\nIt is mild.<|im_end|>",
    "qwen3-hybrid": "<think>\nI will answer.\n</think>\n\nIt is mild.<|im_end|>",
    "deepseek-v3": "It is mild.<｜end▁of▁sentence｜>",
    "llama-3.1": "It is mild.<|eot_id|>",
    "gpt-oss": "<|channel|>analysis<|message|>I will answer.<|end|><|start|>assistant<|channel|>final<|message|>"
    "It is mild.<|return|>",
}


@pytest.mark.parametrize("folder", ANSWERS)
def test_a_generated_answer_is_read_and_rebuilds_to_its_ids(chats, folder):
    chat = chats(folder)
    turn, output = read(chat, ANSWERS[folder])
    assert (turn.content, turn.finish_reason, turn.malformed, turn.tool_calls) == ("It is mild.", "stop", None, None)
    assert turn.reasoning == ("" if folder in ("deepseek-v3", "llama-3.1") else "I will answer.")
    assert rebuilt(chat, ASK, turn, output) == output


def test_deepseek_thinking_mode_answer(chats):
    chat = chats("deepseek-v3", thinking=True)
    turn, output = read(chat, "I will answer.</think>It is mild.<｜end▁of▁sentence｜>")
    assert (turn.reasoning, turn.content, turn.malformed) == ("I will answer.", "It is mild.", None)
    assert rebuilt(chat, ASK, turn, output) == output


def test_parallel_calls_of_qwen3_and_deepseek(chats):
    tools = [*WEATHER, {"type": "function", "function": {"name": "get_time", "description": "Time.", "parameters": {}}}]
    qwen = (
        '<think>\n\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
        '\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call><|im_end|>'
    )
    deepseek = (
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{}<｜tool▁call▁end｜>"
        "<｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{}<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜>"
    )
    for folder, text in (("qwen3-hybrid", qwen), ("deepseek-v3", deepseek)):
        turn, output = read(chats(folder), text, tools=tools)
        assert [c["function"]["name"] for c in turn.tool_calls] == ["get_weather", "get_time"], folder
        assert [c["id"] for c in turn.tool_calls] == ["functions.get_weather:0", "functions.get_time:1"]
        assert rebuilt(chats(folder), ASK, turn, output, tools) == output


def test_calls_that_cannot_be_read_mark_the_turn(chats):
    bad_json = "<tool_call>\n{not json}\n</tool_call><|im_end|>"
    undeclared = '<tool_call>\n{"name": "launch", "arguments": {}}\n</tool_call><|im_end|>'
    for text in (bad_json, undeclared):
        turn, _ = read(chats("qwen3-hybrid"), text)
        assert turn.malformed == "tool_calls" and turn.status == "malformed"
    turn, _ = read(chats("llama-3.1"), '{"name": "get_weather", "parameters": ')
    assert turn.finish_reason == "length"


NEXT = "<|end|><|start|>assistant"
HARMONY_CASES = [
    # SGLang's own layout for a call: the recipient in the channel header, constrained to json
    (
        "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{}<|call|>",
        ("", "", True, True, [("get_weather", "{}")]),
    ),
    ("<|channel|>final<|message|>Hi.<|return|>", ("", "Hi.", True, True, None)),
    ("<|channel|>analysis<|message|>Think", ("", "", False, False, None)),  # cut off
    (f"<|channel|>final<|message|>A{NEXT}<|channel|>final<|message|>B<|return|>", ("", "B", True, False, None)),
    (f"<|channel|>commentary<|message|>A{NEXT}<|channel|>final<|message|>B<|return|>", ("", "B", True, False, None)),
    ("Hi.<|return|>", ("", "Hi.<|return|>", True, False)),
]


@pytest.mark.parametrize(("emitted", "expected"), HARMONY_CASES)
def test_harmony_output_parsing(chats, emitted, expected):
    chat = chats("gpt-oss")
    parsed = chat.family.parse_output(chat.tokenizer, encode(chat.tokenizer, emitted), chat.specials)
    assert tuple(parsed)[: len(expected)] == expected


def test_gpt_oss_generation_stops_at_a_call(chats):
    chat = chats("gpt-oss")
    assert chat.specials.stop_ids == [chat.tokenizer.convert_tokens_to_ids(t) for t in ("<|return|>", "<|call|>")]


def test_registry_names_its_entries_and_refuses_twins():
    plugins = Registry("thing")
    plugins.register("a")(int)
    assert plugins["a"] is int and plugins.names() == ["a"] and "a" in plugins and len(plugins) == 1
    with pytest.raises(ValueError, match="thing 'a' is registered twice"):
        plugins.register("a")(str)
    with pytest.raises(UnknownEntry, match="unknown thing 'b'; registered: a"):
        plugins["b"]
    assert set(FAMILIES) == {"generic", "qwen3", "deepseek-v3", "gpt-oss", "llama-3.1", "kimi-k2.5"}


def test_sglang_layer_numbering_per_architecture():
    """SGLang 0.5.23's `set_eagle3_layers_to_capture` (tests/real_sglang runs the real ones): most
    families capture hidden_states[id + 1]; DeepSeek V2/V3 (Kimi) shift ids only when the first is 1."""
    assert deepseek_sglang_layer_ids([2, 30, 58]) == [1, 29, 57]
    assert deepseek_sglang_layer_ids([3, 30, 58]) == [3, 30, 58]  # [2, 29, 57] would capture one layer early
    with pytest.raises(ValueError, match="cannot capture hidden_states\\[1\\] first"):
        deepseek_sglang_layer_ids([1, 4])
    for model_type in ("qwen3", "qwen3_moe", "llama", "gpt_oss", "mistral"):
        assert family_for_model_type(model_type).sglang_layer_ids([3, 6, 9]) == [2, 5, 8]
    assert family_for_model_type("deepseek_v3").sglang_layer_ids([3, 6, 9]) == [3, 6, 9]
    assert family_for_model_type("kimi_k25").sglang_layer_ids([2, 6, 9]) == [1, 5, 8]
