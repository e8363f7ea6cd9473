"""The tokens stage on the real tokenizers and chat templates of Qwen3 (2507 Thinking and the hybrid
template), DeepSeek-V3.1, gpt-oss and Llama-3.1 (tests/fixtures/targets): every sample equals the
template's own rendering (`apply_chat_template(tokenize=True)`) of what the model saw, followed by what
it produced, from text (OpenRouter-style rows) and from the server's IDs (SGLang-style `output_ids`)
alike; multi-turn, reasoning on and off, tool calls and their results, parallel calls where the template
renders them. Each trained span is asserted as text, so a reader sees what the draft learns."""

import json

import pytest

from eagle3_datagen.chat.families.base import detect_family
from eagle3_datagen.chat.families.target_chat import FAMILIES, TargetChat
from eagle3_datagen.chat.template import TemplateError, encode, template_messages
from eagle3_datagen.config_schema import schema
from eagle3_datagen.stages.tokens import TokenBuilder, loss_spans
from tests.helpers import KIMI_FILES, TARGET_FILES, TEMPLATE_DATE, target_chat, token_settings
from tests.helpers.families import SYSTEM, WEATHER


def user(text):
    return {"role": "user", "content": text}


def reply(content, reasoning="", **extra):
    return {"role": "assistant", "content": content, "reasoning": reasoning, "finish_reason": "stop", **extra}


def call(city, index=0):
    function = {"name": "get_weather", "arguments": json.dumps({"city": city})}
    return {"id": f"functions.get_weather:{index}", "type": "function", "function": function}


def calling(*cities, reasoning=""):
    calls = [call(city, i) for i, city in enumerate(cities)]
    return reply("", reasoning, tool_calls=calls, finish_reason="tool_calls")


def result(content, index=0):
    return {"role": "tool", "tool_call_id": f"functions.get_weather:{index}", "name": "get_weather", "content": content}


def two_turns(reasoning=("Add.", "Add again.")):
    return [SYSTEM, user("What is 2+2?"), reply("4.", reasoning[0]), user("And 3+3?"), reply("6.", reasoning[1])]


def chain(reasoning=("", "")):
    """A call, its result and the answer after it."""
    return [SYSTEM, user("Weather in Paris?"), calling("Paris", reasoning=reasoning[0]), result('{"temp_c": 21}'),
            reply("It is 21C in Paris.", reasoning[1])]  # fmt: skip


def build(chat: TargetChat, messages, tools=None, **settings):
    builder = TokenBuilder(
        chat.tokenizer, chat.specials, token_settings(**settings), chat.template_kwargs, family=chat.family
    )
    row = {"id": "s", "messages": messages, "status": "ok", **({"tools": tools} if tools else {})}
    samples = builder.samples_for(row)
    return samples, builder.report()


def template_ids(chat: TargetChat, messages, add_generation_prompt=False, tools=None) -> list[int]:
    """The template's own tokenization of `messages` (the family's message layout)."""
    return chat.tokenizer.apply_chat_template(
        chat.family.template_messages(messages),
        tools=tools,
        tokenize=True,
        add_generation_prompt=add_generation_prompt,
        return_dict=False,
        **chat.template_kwargs,
    )


def trained(chat: TargetChat, sample) -> list[str]:
    return [chat.tokenizer.decode(span) for span in loss_spans(sample["input_ids"], sample["loss_mask"])]


def through_last_turn(chat: TargetChat, ids: list[int]) -> list[int]:
    """A conversation's rendering cut after its last end-of-turn token (Qwen3 writes a newline after it)."""
    last = len(ids) - ids[::-1].index(chat.specials.end_of_turn_id)
    return ids[:last]


def check_server_ids(chat: TargetChat, messages, sample, tools=None, **settings):
    """The last turn's IDs as a server returns them give the same sample, audited exact."""
    emitted = loss_spans(sample["input_ids"], sample["loss_mask"])[-1]
    served = [*messages[:-1], {**messages[-1], "output_ids": emitted}]
    [from_ids], report = build(chat, served, tools, **settings)
    assert from_ids == sample
    assert report["counts"]["ids_from_server"] == 1 and report["audit"]["exact"] == 1


@pytest.fixture(scope="module")
def qwen3():
    return target_chat("qwen3")


@pytest.fixture(scope="module")
def hybrid():
    return target_chat("qwen3-hybrid")


@pytest.fixture(scope="module")
def deepseek():
    return target_chat("deepseek-v3")


@pytest.fixture(scope="module")
def gpt_oss():
    return target_chat("gpt-oss")


@pytest.fixture(scope="module")
def llama():
    return target_chat("llama-3.1")


def test_each_fixture_is_detected_as_its_family(kimi_fast, qwen_tokenizer):
    for folder, family in [("qwen3", "qwen3"), ("qwen3-hybrid", "qwen3"), ("deepseek-v3", "deepseek-v3"),
                           ("gpt-oss", "gpt-oss"), ("llama-3.1", "llama-3.1")]:  # fmt: skip
        assert target_chat(folder).family.name == family
    assert detect_family(kimi_fast.chat_template).name == "kimi-k2.5"
    assert detect_family(qwen_tokenizer.chat_template).name == "generic"  # the demo's Qwen3-style template
    assert (KIMI_FILES / "chat_template.jinja").exists()


def test_the_schema_lists_the_registered_families():
    family = schema()["properties"]["model"]["properties"]["family"]
    assert sorted(family["enum"]) == sorted(["auto", *FAMILIES]) and family["default"] == "auto"


def test_each_entry_says_what_its_template_does():
    """What a registry entry declares is what the real template does: BOS written by the template,
    the reasoning field it reads, tool-call arguments as a string or an object, parallel calls."""
    chats = {folder: target_chat(folder) for folder in ("qwen3", "deepseek-v3", "gpt-oss", "llama-3.1")}
    for folder, chat in chats.items():
        family, tokenizer = chat.family, chat.tokenizer
        rendered = template_ids(chat, [user("Hi")], add_generation_prompt=True)
        assert (rendered[0] == tokenizer.bos_token_id) == family.bos_in_template, folder
        assert rendered[1] != tokenizer.bos_token_id, folder  # never twice
        messages = [user("Hi"), calling("Paris"), result("21"), reply("Mild.")]
        quoted = json.dumps(call("Paris")["function"]["arguments"])  # the arguments written as a JSON string
        generic = tokenizer.apply_chat_template(template_messages(messages), tokenize=False, **chat.template_kwargs)
        assert (quoted in generic) == (family.tool_arguments == "object"), folder
        text = tokenizer.apply_chat_template(family.template_messages(messages), tokenize=False, **chat.template_kwargs)
        assert quoted not in text and '{"city": "Paris"}' in text, folder
    assert chats["gpt-oss"].family.reasoning_field == "thinking"
    two = [user("Hi"), calling("Paris", "Rome"), result("21"), result("25", 1), reply("Mild.")]
    llama = chats["llama-3.1"]
    with pytest.raises(Exception, match="single tool-calls"):  # Llama 3.1's template raises
        llama.tokenizer.apply_chat_template(llama.family.template_messages(two), tokenize=False)
    gpt_oss = chats["gpt-oss"]
    rendered = gpt_oss.tokenizer.apply_chat_template(gpt_oss.family.template_messages(two[:2]), tokenize=False)
    assert "Rome" not in rendered  # gpt-oss's renders the first call only


def test_template_switches_the_template_does_not_read_are_refused():
    with pytest.raises(TemplateError, match=r"sets \['enable_thinking'\], which the chat template never reads"):
        target_chat("deepseek-v3", chat_template_kwargs={"enable_thinking": False})
    assert target_chat("deepseek-v3", chat_template_kwargs={"thinking": True}).template_kwargs == {"thinking": True}


def test_gpt_oss_renders_the_configured_date_and_refuses_none():
    chat = target_chat("gpt-oss")
    prompt = chat.tokenizer.decode(template_ids(chat, [user("Hi")], add_generation_prompt=True))
    assert f"Current date: {TEMPLATE_DATE}\n" in prompt
    with pytest.raises(TemplateError, match="set model.chat_template_date"):
        target_chat("gpt-oss", chat_template_date=None)


# Qwen3-2507 Thinking: the prompt opens the think block; reasoning shown after the last user query.


def test_qwen3_thinking_multi_turn(qwen3):
    messages = two_turns()
    [sample], report = build(qwen3, messages)
    assert sample["input_ids"] == through_last_turn(qwen3, template_ids(qwen3, messages))
    assert trained(qwen3, sample) == ["4.<|im_end|>", "Add again.\n</think>\n\n6.<|im_end|>"]
    assert report["family"] == "qwen3" and report["special_tokens"]["end_of_turn"] == "<|im_end|>"
    check_server_ids(qwen3, messages, sample)


def test_qwen3_thinking_tool_chain_keeps_both_turns_reasoning(qwen3):
    messages = chain(("I need the weather.", "Report it."))
    [sample], report = build(qwen3, messages, WEATHER)
    assert sample["input_ids"] == through_last_turn(qwen3, template_ids(qwen3, messages, tools=WEATHER))
    assert trained(qwen3, sample) == [
        'I need the weather.\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        "</tool_call><|im_end|>",
        "Report it.\n</think>\n\nIt is 21C in Paris.<|im_end|>",
    ]
    assert report["tools_rendering"] == "template"
    check_server_ids(qwen3, messages, sample, WEATHER)


# Qwen3's hybrid template: enable_thinking (on by default; off closes an empty block in the prompt).


def test_qwen3_hybrid_thinking_on_trains_the_think_block_the_model_opened(hybrid):
    messages = two_turns()
    [sample], _ = build(hybrid, messages)
    assert sample["input_ids"] == through_last_turn(hybrid, template_ids(hybrid, messages))
    assert trained(hybrid, sample) == ["4.<|im_end|>", "<think>\nAdd again.\n</think>\n\n6.<|im_end|>"]
    check_server_ids(hybrid, messages, sample)


def test_qwen3_hybrid_thinking_off(hybrid):
    chat = target_chat("qwen3-hybrid", chat_template_kwargs={"enable_thinking": False})
    messages = two_turns(("", ""))
    [sample], _ = build(chat, messages)
    expected = template_ids(chat, messages[:-1], add_generation_prompt=True) + encode(chat.tokenizer, "6.<|im_end|>")
    assert sample["input_ids"] == expected
    assert chat.tokenizer.decode(expected).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n6.<|im_end|>")
    assert trained(chat, sample) == ["4.<|im_end|>", "6.<|im_end|>"]
    check_server_ids(chat, messages, sample)


def test_qwen3_parallel_calls_and_their_merged_results(hybrid):
    messages = [SYSTEM, user("Paris and Rome?"), calling("Paris", "Rome"), result("21C"), result("25C", 1),
                reply("Paris 21C, Rome 25C.")]  # fmt: skip
    [sample], _ = build(hybrid, messages, WEATHER)
    assert sample["input_ids"] == through_last_turn(hybrid, template_ids(hybrid, messages, tools=WEATHER))
    rendered = hybrid.tokenizer.decode(sample["input_ids"])
    results = "<tool_response>\n21C\n</tool_response>\n<tool_response>\n25C\n</tool_response>"
    assert f"<|im_start|>user\n{results}" in rendered
    first, last = trained(hybrid, sample)
    assert first.count("<tool_call>") == 2 and first.endswith("</tool_call><|im_end|>")
    assert last == "<think>\n\n</think>\n\nParis 21C, Rome 25C.<|im_end|>"
    check_server_ids(hybrid, messages, sample, WEATHER)


# DeepSeek-V3.1: BOS from the template, `thinking` switch, reasoning never rendered.


def test_deepseek_thinking_off(deepseek):
    messages = two_turns(("", ""))
    [sample], _ = build(deepseek, messages)
    assert sample["input_ids"] == template_ids(deepseek, messages)
    assert sample["input_ids"][0] == 0 and 0 not in sample["input_ids"][1:]  # one BOS, the template's
    assert trained(deepseek, sample) == ["4.<｜end▁of▁sentence｜>", "6.<｜end▁of▁sentence｜>"]
    check_server_ids(deepseek, messages, sample)


def test_deepseek_thinking_on_trains_the_reasoning_the_model_emitted(deepseek):
    """The template renders no reasoning; the model, prompted with `<think>`, wrote
    `{reasoning}</think>{answer}<｜end▁of▁sentence｜>`: that is what the sample trains."""
    chat = target_chat("deepseek-v3", chat_template_kwargs={"thinking": True})
    messages = two_turns()
    [sample], _ = build(chat, messages)
    emitted = encode(chat.tokenizer, "Add again.</think>6.<｜end▁of▁sentence｜>")
    assert sample["input_ids"] == template_ids(chat, messages[:-1], add_generation_prompt=True) + emitted
    assert chat.tokenizer.decode(sample["input_ids"]).count("<｜begin▁of▁sentence｜>") == 1
    # the earlier turn as the last prompt renders it (no reasoning, as the template shows history)
    assert trained(chat, sample) == ["</think>4.<｜end▁of▁sentence｜>", "Add again.</think>6.<｜end▁of▁sentence｜>"]
    check_server_ids(chat, messages, sample)


def test_deepseek_parallel_calls_and_the_answer_after_tool_output(deepseek):
    messages = [SYSTEM, user("Paris and Rome?"), calling("Paris", "Rome"), result("21C"), result("25C", 1),
                reply("Paris 21C, Rome 25C.")]  # fmt: skip
    [sample], report = build(deepseek, messages, WEATHER)
    assert sample["input_ids"] == template_ids(deepseek, messages, tools=WEATHER)
    calls = "".join(
        f"<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{json.dumps({'city': city})}<｜tool▁call▁end｜>"
        for city in ("Paris", "Rome")
    )
    assert trained(deepseek, sample) == [
        f"<｜tool▁calls▁begin｜>{calls}<｜tool▁calls▁end｜><｜end▁of▁sentence｜>",
        "Paris 21C, Rome 25C.<｜end▁of▁sentence｜>",  # after tool output: no header, the answer at once
    ]
    assert report["tools_rendering"] == "ignored"  # V3.1's template: declarations go in the system prompt
    check_server_ids(deepseek, messages, sample, WEATHER)


# gpt-oss: harmony channels; <|end|> after past turns, <|return|> after the last, <|call|> after a call.


def test_gpt_oss_multi_turn_with_reasoning(gpt_oss):
    messages = two_turns()
    [sample], report = build(gpt_oss, messages)
    assert sample["input_ids"] == template_ids(gpt_oss, messages)
    assert trained(gpt_oss, sample) == [
        "<|channel|>final<|message|>4.<|end|>",
        "<|channel|>analysis<|message|>Add again.<|end|><|start|>assistant<|channel|>final<|message|>6.<|return|>",
    ]
    assert report["special_tokens"]["end_of_turn"] == "<|return|>"
    assert report["special_tokens"]["turn_ends"] == {"<|end|>": 200007, "<|call|>": 200012}
    check_server_ids(gpt_oss, messages, sample)


def test_gpt_oss_tool_chain_keeps_the_calls_analysis_in_the_answers_prompt(gpt_oss):
    """The answer was generated after the call with its analysis shown (the template drops it only once
    a final answer exists): the sample is that prompt, then the answer as the template renders a last turn."""
    messages = chain(("Need the weather.", "Report it."))
    [sample], report = build(gpt_oss, messages, WEATHER)
    prompt = template_ids(gpt_oss, messages[:-1], add_generation_prompt=True, tools=WEATHER)
    full = gpt_oss.tokenizer.apply_chat_template(
        gpt_oss.family.template_messages(messages), tools=WEATHER, tokenize=False
    )
    assert "Need the weather." not in full  # the whole conversation's rendering dropped it
    last_turn = full[full.rindex("<|start|>assistant<|channel|>analysis") + len("<|start|>assistant") :]
    assert sample["input_ids"] == prompt + encode(gpt_oss.tokenizer, last_turn)
    assert trained(gpt_oss, sample) == [
        "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant to=functions.get_weather"
        '<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>',
        "<|channel|>analysis<|message|>Report it.<|end|><|start|>assistant<|channel|>final<|message|>"
        "It is 21C in Paris.<|return|>",
    ]
    decoded = gpt_oss.tokenizer.decode(sample["input_ids"])
    tool_result = '<|channel|>commentary<|message|>"{\\"temp_c\\": 21}"<|end|>'  # the result written with tojson
    assert f"<|start|>functions.get_weather to=assistant{tool_result}" in decoded
    assert report["tools_rendering"] == "template"
    check_server_ids(gpt_oss, messages, sample, WEATHER)
    # the call turn trained as the last turn ends with <|call|>
    [call_sample], _ = build(gpt_oss, messages[:3], WEATHER)
    assert trained(gpt_oss, call_sample)[-1].endswith("<|call|>")
    check_server_ids(gpt_oss, messages[:3], call_sample, WEATHER)


def test_gpt_oss_parallel_calls_are_left_out_counted(gpt_oss):
    messages = [SYSTEM, user("Paris and Rome?"), calling("Paris", "Rome"), result("21C"), result("25C", 1),
                reply("Both mild.")]  # fmt: skip
    samples, report = build(gpt_oss, messages, WEATHER)
    assert samples == [] and report["counts"]["dropped_parallel_tool_calls"] == 1


# Llama 3.1: BOS from the template, JSON calls written with tojson, results in an ipython turn.


def test_llama_multi_turn(llama):
    messages = two_turns(("", ""))
    [sample], _ = build(llama, messages)
    assert sample["input_ids"] == template_ids(llama, messages)
    assert sample["input_ids"][0] == 128000 and 128000 not in sample["input_ids"][1:]
    assert trained(llama, sample) == ["4.<|eot_id|>", "6.<|eot_id|>"]
    check_server_ids(llama, messages, sample)


def test_llama_tool_call_and_its_ipython_result(llama):
    messages = chain()
    [sample], _ = build(llama, messages, WEATHER)
    assert sample["input_ids"] == template_ids(llama, messages, tools=WEATHER)
    assert trained(llama, sample) == [
        '{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>',
        "It is 21C in Paris.<|eot_id|>",
    ]
    check_server_ids(llama, messages, sample, WEATHER)


@pytest.mark.parametrize("folder", ["qwen3", "qwen3-hybrid", "deepseek-v3", "gpt-oss", "llama-3.1"])
def test_loss_turns_last_and_keep_all_on_every_family(folder):
    """The other loss settings on each template: `last` keeps the IDs and trains the last turn only;
    `keep_all` trains each turn after its own prompt, which is that turn's sample prefix."""
    chat = target_chat(folder)
    messages = two_turns(("", "")) if folder in ("deepseek-v3", "llama-3.1") else two_turns()
    [every], _ = build(chat, messages)
    [last], _ = build(chat, messages, loss_turns="last")
    assert last["input_ids"] == every["input_ids"] and trained(chat, last) == trained(chat, every)[-1:]
    first, second = build(chat, messages, thinking="keep_all")[0]
    assert second["input_ids"] == every["input_ids"] and len(trained(chat, first)) == 1
    assert (
        first["input_ids"]
        == template_ids(chat, messages[:2], add_generation_prompt=True)
        + loss_spans(first["input_ids"], first["loss_mask"])[0]
    )


def test_stop_tokens_include_a_calls_end(gpt_oss, llama):
    assert gpt_oss.specials.stop_ids == [200002, 200012]  # <|return|>, <|call|>
    assert llama.specials.stop_ids == [128009]
    assert TARGET_FILES.joinpath("llama-3.1", "NOTICE").exists()  # kept beside Llama's files
