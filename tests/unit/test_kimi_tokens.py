"""The tokens stage on Kimi-K2.5's real tokenizer and chat template.

Every test runs on both ways a Kimi model directory is tokenized: the fast tokenizer built from
its `tiktoken.model` (`kimi_fast`) and a remote-code slow tokenizer loaded with
`trust_remote_code` (`kimi_slow`; the project's own over `tiktoken`, standing in for Moonshot's
`TikTokenTokenizer`, which cannot be vendored). Structural IDs are Kimi's special tokens; word
pieces are encoded by the fast tokenizer, itself checked against `tiktoken` in
test_tiktoken_fast.py; the held-out tests at the end compare with third-party tokenizations.
"""

import json

import pytest

from eagle3_datagen.chat.template import render_generation_prompt, resolve_special_tokens, tools_rendering
from eagle3_datagen.formats.files import read_jsonl, write_jsonl_zst
from eagle3_datagen.stages.tokens import TokenBuilder, run_tokens
from tests.helpers import defaults, token_settings

IM_END, IM_USER, IM_ASSISTANT, IM_SYSTEM, IM_MIDDLE = 163586, 163587, 163588, 163594, 163601
THINK, END_THINK = 163606, 163607
CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_ARGUMENTS, CALL_END = 163595, 163596, 163597, 163598, 163599
USER, ASSISTANT = 2482, 69702
HEADER = [IM_ASSISTANT, ASSISTANT, IM_MIDDLE]

TOKENIZERS = ["kimi_fast", "kimi_slow"]


@pytest.fixture(params=TOKENIZERS)
def kimi(request):
    return request.getfixturevalue(request.param)


@pytest.fixture(scope="module")
def pieces(kimi_fast):
    """Ordinary text -> Kimi IDs (the fast tokenizer, checked against tiktoken elsewhere)."""
    return lambda text: kimi_fast.encode(text, add_special_tokens=False)


def user(text, **extra):
    return {"role": "user", "content": text, **extra}


def reply(content, reasoning="", **extra):
    return {"role": "assistant", "content": content, "reasoning": reasoning, "finish_reason": "stop", **extra}


def builder(tokenizer, template_kwargs=None, **settings):
    specials = resolve_special_tokens(tokenizer, template_kwargs=template_kwargs)
    return TokenBuilder(tokenizer, specials, token_settings(**settings), template_kwargs)


def build(tokenizer, messages, template_kwargs=None, tools=None, **settings):
    b = builder(tokenizer, template_kwargs, **settings)
    row = {"id": "s", "messages": messages, "status": "ok", **({"tools": tools} if tools else {})}
    return b.samples_for(row), b.report()


def pairs(sample):
    return list(zip(sample["input_ids"], sample["loss_mask"], strict=True))


def unmasked(ids):
    return [(t, 0) for t in ids]


def masked(ids):
    return [(t, 1) for t in ids]


def user_turn(ids):
    return [IM_USER, USER, IM_MIDDLE, *ids, IM_END]


def test_special_ids_and_flags(kimi):
    specials = resolve_special_tokens(kimi)
    assert (specials.end_of_turn, specials.end_of_turn_id) == ("<|im_end|>", IM_END)
    assert (specials.think_start_id, specials.think_end_id) == (THINK, END_THINK)
    # <think> and </think> are not special tokens in K2.5's config, so not template control tokens.
    assert specials.template_tokens == {
        "<|im_system|>": IM_SYSTEM,
        "<|im_user|>": IM_USER,
        "<|im_middle|>": IM_MIDDLE,
        "<|im_end|>": IM_END,
        "<|im_assistant|>": IM_ASSISTANT,
    }
    special = {i for i, token in kimi.added_tokens_decoder.items() if token.special}
    assert {IM_END, IM_USER, IM_ASSISTANT, IM_SYSTEM, IM_MIDDLE, 163700} <= special
    assert not {THINK, END_THINK, CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_ARGUMENTS, CALL_END} & special
    assert len(kimi) == 163840


@pytest.mark.parametrize(("template_kwargs", "tail"), [({}, [THINK]), ({"thinking": False}, [THINK, END_THINK])])
def test_generation_prompt_with_and_without_thinking(kimi, pieces, template_kwargs, tail):
    # No default system prompt: the conversation starts with the user turn.
    ids = render_generation_prompt(kimi, [user("Hi")], template_kwargs=template_kwargs)
    assert ids == [*user_turn(pieces("Hi")), *HEADER, *tail]


def test_named_user_replaces_the_role_text(kimi, pieces):
    ids = render_generation_prompt(kimi, [user("Hi", name="Alice")])
    assert ids == [IM_USER, *pieces("Alice"), IM_MIDDLE, *pieces("Hi"), IM_END, *HEADER, THINK]


TURNS = [("Hi", "greet", "Hello."), ("Bye", "part", "Goodbye."), ("Again?", "why not", "Sure, 123 times.")]


def conversation(n, output_ids=None):
    messages = []
    for question, reasoning, answer in TURNS[:n]:
        messages += [user(question), reply(answer, reasoning)]
    if output_ids is not None:
        messages[-1]["output_ids"] = output_ids
    return messages


def emitted(pieces, reasoning, answer):
    """What K2.5 emits after a generation prompt that opened `<think>`."""
    return [*pieces(reasoning), END_THINK, *pieces(answer), IM_END]


@pytest.mark.parametrize("n", [1, 3])
def test_keep_last_trains_earlier_turns_as_the_last_prompt_renders_them(kimi, pieces, n):
    [sample], _ = build(kimi, conversation(n))
    expected = []
    for question, _, answer in TURNS[: n - 1]:
        # Earlier turns render with an empty think block; the prompt already opened it.
        expected += unmasked([*user_turn(pieces(question)), *HEADER, THINK])
        expected += masked([END_THINK, *pieces(answer), IM_END])
    question, reasoning, answer = TURNS[n - 1]
    expected += unmasked([*user_turn(pieces(question)), *HEADER, THINK]) + masked(emitted(pieces, reasoning, answer))
    assert pairs(sample) == expected


@pytest.mark.parametrize("thinking", ["keep_last", "drop"])
def test_loss_turns_last_keeps_the_earlier_turns_as_context_only(kimi, pieces, thinking):
    """tokens.loss_turns: last gives the same IDs as all, the earlier turns out of the loss."""
    [every], _ = build(kimi, conversation(3), thinking=thinking)
    [last], report = build(kimi, conversation(3), thinking=thinking, loss_turns="last")
    assert last["input_ids"] == every["input_ids"] and report["settings"]["loss_turns"] == "last"
    question, reasoning, answer = TURNS[2]
    trained = emitted(pieces, reasoning, answer) if thinking == "keep_last" else [END_THINK, *pieces(answer), IM_END]
    prompt = len(last["input_ids"]) - len(trained)
    assert pairs(last) == unmasked(every["input_ids"][:prompt]) + masked(trained)
    # the earlier turns' answers were in the loss with `all`: two turns' worth of tokens more
    earlier = sum(len([END_THINK, *pieces(a), IM_END]) for _, _, a in TURNS[:2])
    assert sum(every["loss_mask"]) - sum(last["loss_mask"]) == earlier


@pytest.mark.parametrize("n", [1, 3])
def test_keep_all_trains_each_turn_after_its_own_prompt(kimi, pieces, n):
    samples, _ = build(kimi, conversation(n), thinking="keep_all")
    assert [s["id"] for s in samples] == [f"s/{k}" for k in range(n)]
    history = []
    for sample, (question, reasoning, answer) in zip(samples, TURNS, strict=False):
        prompt = [*history, *user_turn(pieces(question)), *HEADER, THINK]
        assert pairs(sample) == unmasked(prompt) + masked(emitted(pieces, reasoning, answer))
        history = [*prompt, END_THINK, *pieces(answer), IM_END]


@pytest.mark.parametrize("n", [1, 3])
def test_drop_trains_every_turn_without_reasoning(kimi, pieces, n):
    [sample], _ = build(kimi, conversation(n), thinking="drop")
    expected = []
    for question, _, answer in TURNS[:n]:
        expected += unmasked([*user_turn(pieces(question)), *HEADER, THINK])
        expected += masked([END_THINK, *pieces(answer), IM_END])
    assert pairs(sample) == expected


def test_thinking_off_trains_the_answers_after_the_closed_block(kimi, pieces):
    messages = [user("Hi"), reply("Hello."), user("Bye"), reply("Goodbye.")]
    [sample], _ = build(kimi, messages, {"thinking": False})
    assert pairs(sample) == [
        *unmasked([*user_turn(pieces("Hi")), *HEADER, THINK, END_THINK]),
        *masked([*pieces("Hello."), IM_END]),
        *unmasked([*user_turn(pieces("Bye")), *HEADER, THINK, END_THINK]),
        *masked([*pieces("Goodbye."), IM_END]),
    ]


@pytest.mark.parametrize("thinking", ["keep_last", "keep_all"])
@pytest.mark.parametrize("n", [1, 3])
def test_text_and_server_ids_give_identical_samples_audited_exact(kimi, pieces, n, thinking):
    from_text, _ = build(kimi, conversation(n), thinking=thinking)
    _, reasoning, answer = TURNS[n - 1]
    from_ids, report = build(kimi, conversation(n, emitted(pieces, reasoning, answer)), thinking=thinking)
    assert from_ids[-1] == from_text[-1]
    assert report["counts"]["ids_from_server"] == 1
    audit = report["audit"]
    assert (audit["turns_compared"], audit["exact"], audit["bpe_only"], audit["semantic"]) == (1, 1, 0, 0)


def test_server_ids_split_differently_are_bpe_only_and_trained_as_generated(kimi, pieces):
    split = [*pieces("gr"), *pieces("eet"), END_THINK, *pieces("Hello."), IM_END]
    [sample], report = build(kimi, [user("Hi"), reply("Hello.", "greet", output_ids=split)])
    assert [t for t, m in pairs(sample) if m] == split
    assert (report["audit"]["exact"], report["audit"]["bpe_only"], report["audit"]["semantic"]) == (0, 1, 0)


WEATHER_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]


def weather_call(index=0, city="Paris"):
    return {
        "id": f"functions.get_weather:{index}",
        "type": "function",
        "function": {"name": "get_weather", "arguments": json.dumps({"city": city})},
    }


def weather_result(index=0, content="18C"):
    return {"role": "tool", "tool_call_id": f"functions.get_weather:{index}", "name": "get_weather", "content": content}


def call_ids(pieces, index=0, city="Paris"):
    call = weather_call(index, city)
    return [
        CALLS_BEGIN,
        CALL_BEGIN,
        *pieces(call["id"]),
        CALL_ARGUMENTS,
        *pieces(call["function"]["arguments"]),
        CALL_END,
        CALLS_END,
    ]


def tool_declaration(pieces):
    return [IM_SYSTEM, *pieces("tool_declare"), IM_MIDDLE, *pieces(json.dumps(WEATHER_TOOLS, separators=(",", ":")))]


def result_ids(pieces, index=0, content="18C"):
    return [
        IM_SYSTEM,
        *pieces("get_weather"),
        IM_MIDDLE,
        *pieces(f"## Return of functions.get_weather:{index}\n{content}"),
    ]


def test_tool_call_chain_keeps_its_reasoning_where_k25_keeps_it(kimi, pieces):
    messages = [
        user("Weather in Paris?"),
        reply("", "need weather", tool_calls=[weather_call()], finish_reason="tool_calls"),
        weather_result(),
        reply("It is 18C.", "answer"),
    ]
    [sample], report = build(kimi, messages, tools=WEATHER_TOOLS)
    # The answer was generated after the call turn with its reasoning shown (K2.5 blanks a chain
    # only once its final answer exists): the sample is that context, then the answer.
    assert pairs(sample) == [
        *unmasked([*tool_declaration(pieces), IM_END, *user_turn(pieces("Weather in Paris?")), *HEADER, THINK]),
        *masked([*pieces("need weather"), END_THINK, *call_ids(pieces), IM_END]),
        *unmasked([*result_ids(pieces), IM_END, *HEADER, THINK]),
        *masked(emitted(pieces, "answer", "It is 18C.")),
    ]
    # The fast tokenizer built from the files and the project's remote-code one both leave the
    # declarations to the template (JSON); Moonshot's tokenizer hands it TypeScript instead.
    assert report["tools_rendering"] == "template"
    # The call turn, trained as the last turn from server IDs, is audited exact; the server counted
    # the prompt with the tools declared, as rendered here.
    output = [*pieces("need weather"), END_THINK, *call_ids(pieces), IM_END]
    prompt = [*tool_declaration(pieces), IM_END, *user_turn(pieces("Weather in Paris?")), *HEADER, THINK]
    served = {**messages[1], "output_ids": output, "usage": {"prompt_tokens": len(prompt)}}
    [call_sample], call_report = build(kimi, [messages[0], served], tools=WEATHER_TOOLS)
    assert pairs(call_sample) == unmasked(prompt) + masked(output)
    assert call_report["audit"]["exact"] == 1
    assert "server_prompt_length_differs" not in call_report["counts"]
    # Without the tools the rendered prompt is not what the server saw: counted.
    _, untooled = build(kimi, [messages[0], served])
    assert untooled["counts"]["server_prompt_length_differs"] == 1


def test_two_tool_call_chains_in_one_conversation(kimi, pieces):
    # The second question's prompt blanks the first chain (its answer exists) but shows the
    # second chain's reasoning: each turn is trained where that prompt renders it.
    messages = [
        user("Weather in Paris?"),
        reply("", "need Paris", tool_calls=[weather_call(0)], finish_reason="tool_calls"),
        weather_result(0),
        reply("It is 18C.", "answer one"),
        user("And Rome?"),
        reply("", "need Rome", tool_calls=[weather_call(0, "Rome")], finish_reason="tool_calls"),
        weather_result(0, "25C"),
        reply("It is 25C.", "answer two"),
    ]
    [sample], _ = build(kimi, messages, tools=WEATHER_TOOLS)
    assert pairs(sample) == [
        *unmasked([*tool_declaration(pieces), IM_END, *user_turn(pieces("Weather in Paris?")), *HEADER, THINK]),
        *masked([END_THINK, *call_ids(pieces), IM_END]),
        *unmasked([*result_ids(pieces), IM_END, *HEADER, THINK]),
        *masked([END_THINK, *pieces("It is 18C."), IM_END]),
        *unmasked([*user_turn(pieces("And Rome?")), *HEADER, THINK]),
        *masked([*pieces("need Rome"), END_THINK, *call_ids(pieces, 0, "Rome"), IM_END]),
        *unmasked([*result_ids(pieces, 0, "25C"), IM_END, *HEADER, THINK]),
        *masked(emitted(pieces, "answer two", "It is 25C.")),
    ]


def glaive_row(pieces):
    """A B1_glaive record after generation, in the record contract's layout: the glaive function
    as an OpenAI tool, a regenerated call matching the recorded one, the recorded result reused,
    and the final answer with the server's IDs."""
    tools = [
        {
            "type": "function",
            "function": {
                "name": "calculate_tip",
                "description": "Calculate the tip amount for a bill",
                "parameters": {
                    "type": "object",
                    "properties": {
                        "bill_amount": {"type": "number", "description": "The total bill amount"},
                        "tip_percentage": {"type": "number", "description": "The percentage of tip to be given"},
                    },
                    "required": ["bill_amount", "tip_percentage"],
                },
            },
        }
    ]
    call = {
        "id": "functions.calculate_tip:0",
        "type": "function",
        "function": {"name": "calculate_tip", "arguments": '{"bill_amount": 50, "tip_percentage": 15}'},
    }
    answer = "The tip for a $50 bill at 15% is $7.50."
    return {
        "id": "glaive-0",
        "status": "ok",
        "tools": tools,
        "messages": [
            {"role": "system", "content": "You are a helpful assistant with access to functions."},
            user("I need help calculating a 15% tip on my $50 bill."),
            reply("", "Use calculate_tip.", tool_calls=[call], finish_reason="tool_calls", turn=0),
            {
                "role": "tool",
                "tool_call_id": "functions.calculate_tip:0",
                "name": "calculate_tip",
                "content": '{"tip_amount": 7.5}',
            },
            reply(answer, "Report it.", turn=1, output_ids=emitted(pieces, "Report it.", answer)),
        ],
    }


def test_glaive_record_end_to_end_through_a_remote_code_model_directory(kimi_remote_code_dir, pieces, tmp_path):
    """The stage as the workflow runs it, on a model directory whose tokenizer is remote-code slow."""
    responses = tmp_path / "responses.jsonl.zst"
    write_jsonl_zst(responses, [glaive_row(pieces)])
    model = defaults("model", path=str(kimi_remote_code_dir), trust_remote_code=True)
    run_tokens(
        responses,
        tmp_path / "tokens.jsonl.zst",
        tmp_path / "audit.json",
        model["path"],
        model,
        token_settings(),
    )
    [sample] = read_jsonl(tmp_path / "tokens.jsonl.zst")
    audit = json.loads((tmp_path / "audit.json").read_text())
    row = glaive_row(pieces)
    [call] = row["messages"][2]["tool_calls"]
    declaration = json.dumps(row["tools"], separators=(",", ":"))
    assert pairs(sample) == [
        *unmasked([IM_SYSTEM, *pieces("tool_declare"), IM_MIDDLE, *pieces(declaration), IM_END]),
        *unmasked([IM_SYSTEM, *pieces("system"), IM_MIDDLE, *pieces(row["messages"][0]["content"]), IM_END]),
        *unmasked([*user_turn(pieces(row["messages"][1]["content"])), *HEADER, THINK]),
        *masked([*pieces("Use calculate_tip."), END_THINK, CALLS_BEGIN, CALL_BEGIN, *pieces(call["id"])]),
        *masked([CALL_ARGUMENTS, *pieces(call["function"]["arguments"]), CALL_END, CALLS_END, IM_END]),
        *unmasked([IM_SYSTEM, *pieces("calculate_tip"), IM_MIDDLE]),
        *unmasked([*pieces('## Return of functions.calculate_tip:0\n{"tip_amount": 7.5}'), IM_END, *HEADER, THINK]),
        *masked(row["messages"][4]["output_ids"]),
    ]
    assert audit["tokenizer"] == {
        "model": "TiktokenTokenizer (slow)",
        "encoder": "TokenizersBackend (fast)",
        "checked_against_model": True,
    }
    assert (audit["boundaries"], audit["tools_rendering"]) == ("offsets", "template")
    assert audit["counts"]["encoder_checked_samples"] == 1 and audit["counts"]["rows_with_tools"] == 1
    assert (audit["audit"]["exact"], audit["audit"]["semantic"]) == (1, 0)


def test_a_tokenizer_that_renders_tools_itself_is_named_in_the_audit(kimi_fast):
    """Kimi-K2.5's own tokenizer passes the template a TypeScript `tools_ts_str`; a subclass that
    does the same (with a marker, not Moonshot's code) must be reported as rendering the tools."""

    class RendersTools(type(kimi_fast)):
        def apply_chat_template(self, conversation, tools=None, **kwargs):
            if tools:
                kwargs["tools_ts_str"] = "namespace functions { ... }"
            return super().apply_chat_template(conversation, tools=tools, **kwargs)

    own = RendersTools(tokenizer_object=kimi_fast.backend_tokenizer, chat_template=kimi_fast.chat_template)
    assert tools_rendering(kimi_fast) == "template"
    assert tools_rendering(own) == "tokenizer"
    ids = render_generation_prompt(own, [user("Hi")], tools=WEATHER_TOOLS)
    assert own.decode(ids).startswith("<|im_system|>tool_declare<|im_middle|>namespace functions { ... }<|im_end|>")


# Held-out checks against tokenizations published by others.


def test_held_out_kimi_linear_chat_tokenization(kimi):
    """huggingface/transformers, tests/models/kimi_linear/test_modeling_kimi_linear.py (commit
    9a6ad158), `KimiLinearIntegrationTest.test_large_model_integration_test`: Kimi-Linear-48B's
    tokenizer (the same ranks and special tokens as K2.5) renders the user message "Tell me about
    the french revolution." with the generation prompt as the IDs below. K2.5's template renders the
    same turn and header, then opens `<think>`."""
    published = [163587, 2482, 163601, 69211, 1019, 1215, 276, 64782, 25317, 13, 163586, 163588, 69702, 163601]
    ids = render_generation_prompt(kimi, [user("Tell me about the french revolution.")])
    assert ids == [*published, THINK]


# Systemcluster/kitoken, tests/data/small_input.txt and tests/data/tiktoken/small_tokens_kimi_k2.txt
# (commit ddea1438): lines 1, 2 and 7 of the input and kitoken's Kimi-K2 IDs for them.
KITOKEN = [
    ("Hello\nmy love!", [19180, 198, 5636, 3270, 0]),
    (
        "I go a little more up and I find someone or something there.\nYellow in color, with a head like a "
        "pointed top and a wire-like, slender body.",
        [40, 970, 261, 3572, 1070, 979, 316, 374, 2086, 6320, 528, 3692, 1459, 341, 83641, 306, 3278, 11, 472]
        + [261, 3391, 1517, 261, 27473, 2566, 316, 261, 8695, 19532, 11, 135259, 4120, 13],
    ),
    (
        'I held the card up to the pad and hit "send." Voilà, the door magically opened. On the other side was '
        "Blood, wearing a janitor's uniform for the Dallas airport and standing behind a large Rubbermaid trash "
        "receptacle.",
        [40, 7549, 276, 5429, 979, 308, 276, 17116, 316, 7435, 414, 15256, 5046, 50743, 334, 10615, 11, 276, 8078]
        + [133488, 12539, 13, 3282, 276, 1356, 4594, 743, 41915, 11, 19916, 261, 45624, 2827, 1048, 20056, 395]
        + [276, 33495, 19056, 316, 17399, 7740, 261, 4393, 90410, 105633, 25439, 48964, 11320, 13],
    ),
]


@pytest.mark.parametrize("source", ["text", "server"])
def test_held_out_kitoken_texts_inside_a_k25_sample(kimi, source):
    """A conversation whose user message, reasoning and answer are kitoken's test texts: the sample
    holds kitoken's published IDs for each, between K2.5's structural tokens, from text and from
    server IDs alike."""
    (question, question_ids), (reasoning, reasoning_ids), (answer, answer_ids) = KITOKEN
    output = [*reasoning_ids, END_THINK, *answer_ids, IM_END]
    turn = reply(answer, reasoning, **({"output_ids": output} if source == "server" else {}))
    [sample], report = build(kimi, [user(question), turn])
    assert pairs(sample) == unmasked([*user_turn(question_ids), *HEADER, THINK]) + masked(output)
    assert report["audit"]["semantic"] == 0
