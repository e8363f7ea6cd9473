"""Token reconstruction against hand-written ID sequences in a Kimi-K2.5-style tokenizer.

The fixture has Kimi's special tokens at Kimi's IDs and Kimi's template layout over Qwen's
BPE ranks; the word pieces below are those ranks' IDs, written out by hand.
"""

import pytest

from eagle3_datagen.chat import TemplateError, encode, load_tokenizer, resolve_special_tokens
from eagle3_datagen.tokens import TokenBuilder, TokenSettings

# Kimi-K2.5's special tokens
IM_END, IM_USER, IM_ASSISTANT, IM_SYSTEM, IM_MIDDLE = 163586, 163587, 163588, 163594, 163601
THINK, END_THINK = 163606, 163607
CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_ARGUMENTS, CALL_END = 163595, 163596, 163597, 163598, 163599
# Qwen BPE pieces
SYSTEM, USER, ASSISTANT, TOOL = [8948], [872], [77091], [14172]
DEFAULT_SYSTEM = [2610, 525, 13509, 72, 11, 458, 15235, 17847, 3465, 553, 17330, 6340, 15235, 13]  # You are Kimi, ...
TERSE = [2610, 525, 50537, 13]  # You are terse.
HI, BYE, HELLO, GOODBYE = [13048], [1359, 68], [9707, 13], [15216, 28374, 13]
GREET, PART = [70, 3744], [4480]
WEATHER_QUESTION = [28981, 304, 12095, 30]  # Weather in Paris?
CALL_ID = [21409, 670, 69364, 25, 15]  # functions.get_weather:0
ARGUMENTS = [4913, 8926, 788, 330, 59604, 9207]  # {"city": "Paris"}
RETURN_18C = [565, 3411, 315, 5746, 670, 69364, 25, 15, 198, 16, 23, 34]  # ## Return of functions.get_weather:0\n18C
IT_IS_18C = [2132, 374, 220, 16, 23, 34, 13]  # It is 18C.
NEED_WEATHER, ANSWER = [17046, 9104], [9217]


def header(role_token, role):
    return [role_token, *role, IM_MIDDLE]


def system_turn(text):
    return [*header(IM_SYSTEM, SYSTEM), *text, IM_END]


def user_turn(text):
    return [*header(IM_USER, USER), *text, IM_END]


ASSISTANT_HEADER = header(IM_ASSISTANT, ASSISTANT)


def user(text):
    return {"role": "user", "content": text}


def reply(content, reasoning="", **extra):
    return {"role": "assistant", "content": content, "reasoning": reasoning, "finish_reason": "stop", **extra}


WEATHER_CALL = {
    "id": "functions.get_weather:0",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
}


def tool_conversation():
    return [
        user("Weather in Paris?"),
        reply("", "need weather", tool_calls=[WEATHER_CALL]),
        {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "18C"},
        reply("It is 18C.", "answer"),
    ]


@pytest.fixture(scope="module")
def kimi(kimi_tokenizer_dir):
    return load_tokenizer(kimi_tokenizer_dir)


def build(tokenizer, messages, template_kwargs=None, **settings):
    specials = resolve_special_tokens(tokenizer, template_kwargs=template_kwargs)
    builder = TokenBuilder(tokenizer, specials, TokenSettings(**settings), template_kwargs)
    return builder.samples_for({"id": "s", "messages": messages, "status": "ok"})


def as_pairs(sample):
    return list(zip(sample["input_ids"], sample["loss_mask"], strict=True))


def unmasked(ids):
    return [(t, 0) for t in ids]


def masked(ids):
    return [(t, 1) for t in ids]


def test_special_tokens_are_read_at_kimis_ids(kimi):
    specials = resolve_special_tokens(kimi)
    assert (specials.end_of_turn, specials.end_of_turn_id) == ("<|im_end|>", IM_END)
    assert (specials.think_start_id, specials.think_end_id) == (THINK, END_THINK)
    assert specials.template_tokens == {
        "<|im_system|>": IM_SYSTEM,
        "<|im_middle|>": IM_MIDDLE,
        "<|im_end|>": IM_END,
        "<|im_user|>": IM_USER,
        "<|im_assistant|>": IM_ASSISTANT,
        "<think>": THINK,
        "</think>": END_THINK,
    }


def test_a_neighbouring_end_of_turn_or_a_misremembered_id_fails_loudly(kimi):
    with pytest.raises(TemplateError, match=r"end_of_turn is '\[EOS\]', but the chat template ends .* '<\|im_end\|>'"):
        resolve_special_tokens(kimi, {"end_of_turn": "[EOS]"})
    with pytest.raises(TemplateError, match=r"'<\|im_end\|>' is 163585, but this tokenizer maps it to 163586"):
        resolve_special_tokens(kimi, {"expected_ids": {"<|im_end|>": 163585}})
    with pytest.raises(TemplateError, match=r"'<\|im_start\|>' encodes to \d+ IDs"):
        resolve_special_tokens(kimi, {"end_of_turn": "<|im_start|>"})


def test_no_system_gets_the_default_system_prompt(kimi):
    [sample] = build(kimi, [user("Hi"), reply("Hello.", "greet")])
    assert as_pairs(sample) == [
        *unmasked(system_turn(DEFAULT_SYSTEM) + user_turn(HI) + ASSISTANT_HEADER),
        *masked([THINK, *GREET, END_THINK, *HELLO, IM_END]),
    ]


def test_given_system_prompt_replaces_the_default(kimi):
    [sample] = build(kimi, [{"role": "system", "content": "You are terse."}, user("Hi"), reply("Hello.", "greet")])
    assert as_pairs(sample) == [
        *unmasked(system_turn(TERSE) + user_turn(HI) + ASSISTANT_HEADER),
        *masked([THINK, *GREET, END_THINK, *HELLO, IM_END]),
    ]


MULTI_TURN = [user("Hi"), reply("Hello.", "greet"), user("Bye"), reply("Goodbye.", "part")]


def test_multi_turn_keep_last_blanks_earlier_reasoning_as_the_model_sees_it(kimi):
    [sample] = build(kimi, MULTI_TURN)
    assert as_pairs(sample) == [
        *unmasked(system_turn(DEFAULT_SYSTEM) + user_turn(HI) + ASSISTANT_HEADER),
        *masked([THINK, END_THINK, *HELLO, IM_END]),
        *unmasked(user_turn(BYE) + ASSISTANT_HEADER),
        # the template renders this turn blank too; it is trained as generated
        *masked([THINK, *PART, END_THINK, *GOODBYE, IM_END]),
    ]


def test_multi_turn_keep_all_trains_each_turn_with_its_reasoning(kimi):
    first, second = build(kimi, MULTI_TURN, thinking="keep_all")
    assert (first["id"], second["id"]) == ("s/0", "s/1")
    assert as_pairs(first) == [
        *unmasked(system_turn(DEFAULT_SYSTEM) + user_turn(HI) + ASSISTANT_HEADER),
        *masked([THINK, *GREET, END_THINK, *HELLO, IM_END]),
    ]
    assert as_pairs(second) == [
        *unmasked(system_turn(DEFAULT_SYSTEM) + user_turn(HI) + ASSISTANT_HEADER + [THINK, END_THINK] + HELLO),
        *unmasked([IM_END] + user_turn(BYE) + ASSISTANT_HEADER),
        *masked([THINK, *PART, END_THINK, *GOODBYE, IM_END]),
    ]


def test_multi_turn_drop_trains_content_only(kimi):
    [sample] = build(kimi, MULTI_TURN, thinking="drop")
    assert as_pairs(sample) == [
        *unmasked(system_turn(DEFAULT_SYSTEM) + user_turn(HI) + ASSISTANT_HEADER),
        *masked([THINK, END_THINK, *HELLO, IM_END]),
        *unmasked(user_turn(BYE) + ASSISTANT_HEADER),
        *masked([THINK, END_THINK, *GOODBYE, IM_END]),
    ]


def test_thinking_off_generation_prompt_is_not_trained(kimi):
    [sample] = build(kimi, [user("Hi"), reply("Hello."), user("Bye"), reply("Goodbye.")], {"thinking": False})
    assert as_pairs(sample) == [
        *unmasked(system_turn(DEFAULT_SYSTEM) + user_turn(HI) + ASSISTANT_HEADER + [THINK, END_THINK]),
        *masked([*HELLO, IM_END]),
        *unmasked(user_turn(BYE) + ASSISTANT_HEADER + [THINK, END_THINK]),
        *masked([*GOODBYE, IM_END]),
    ]


def test_tool_call_turn_keeps_its_reasoning_in_the_answers_context(kimi):
    # The final answer was generated after the call turn with its reasoning shown (the template
    # blanks it only once a plain answer exists): the sample is that context plus the answer.
    [sample] = build(kimi, tool_conversation())
    call = [CALLS_BEGIN, CALL_BEGIN, *CALL_ID, CALL_ARGUMENTS, *ARGUMENTS, CALL_END, CALLS_END]
    assert as_pairs(sample) == [
        *unmasked(system_turn(DEFAULT_SYSTEM) + user_turn(WEATHER_QUESTION) + ASSISTANT_HEADER),
        *masked([THINK, *NEED_WEATHER, END_THINK, *call, IM_END]),
        *unmasked([*header(IM_SYSTEM, TOOL), *RETURN_18C, IM_END, *ASSISTANT_HEADER]),
        *masked([THINK, *ANSWER, END_THINK, *IT_IS_18C, IM_END]),
    ]
    # Asked for on its own, the call turn is the last turn and keeps its reasoning.
    [call_only] = build(kimi, tool_conversation()[:2])
    assert [t for t, m in as_pairs(call_only) if m] == [THINK, *NEED_WEATHER, END_THINK, *call, IM_END]


def test_server_ids_audited_against_the_turn_rebuilt_as_generated(kimi):
    generated = [THINK, *encode(kimi, "part"), END_THINK, *encode(kimi, "Goodbye."), IM_END]
    bpe_split = [THINK, *encode(kimi, "pa"), *encode(kimi, "rt"), END_THINK, *encode(kimi, "Goodbye."), IM_END]
    specials = resolve_special_tokens(kimi)
    builder = TokenBuilder(kimi, specials, TokenSettings())
    for output_ids in (generated, bpe_split):
        messages = [*MULTI_TURN[:3], reply("Goodbye.", "part", output_ids=output_ids)]
        [sample] = builder.samples_for({"id": "s", "messages": messages, "status": "ok"})
        assert [t for t, m in as_pairs(sample) if m][-len(output_ids) :] == output_ids
    audit = builder.report()["audit"]
    assert (audit["exact"], audit["bpe_only"], audit["semantic"]) == (1, 1, 0)
