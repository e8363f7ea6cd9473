"""The tiny Kimi target's turns (targets/tiny_kimi.py): what Kimi-K2.5's template renders after its
generation prompt, and the turns regenerated along a recorded tool chain."""

from eagle3_datagen.chat.template import render_text, resolve_special_tokens
from eagle3_datagen.chat.tool_calls import derive_markers
from eagle3_datagen.formats.datasets import link_tool_calls
from eagle3_datagen.targets.tiny_kimi import kimi_turn_text, regeneration_turns

REASONING = "I will answer briefly."
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def weather_call(call_id):
    return {"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}


def test_turn_text_is_what_the_k25_template_renders_after_its_generation_prompt(kimi_fast):
    user = [{"role": "user", "content": "Weather in Paris?"}]
    call = {
        "role": "assistant",
        "content": "",
        "reasoning": "Call it.",
        "tool_calls": [weather_call("functions.get_weather:0")],
    }
    plain = {"role": "assistant", "content": "Sunny.", "reasoning": "Easy."}
    # A tool-call turn keeps its reasoning in K2.5's rendering; a plain last turn does so only when the
    # template is asked to preserve thinking. Either way: generation prompt + exactly what the model emits.
    specials, markers = resolve_special_tokens(kimi_fast), derive_markers(kimi_fast)
    for turn, tools, kwargs in ((call, [WEATHER_TOOL], {}), (plain, None, {"preserve_thinking": True})):
        prompt = render_text(kimi_fast, user, True, kwargs, tools)
        assert prompt.endswith("<|im_assistant|>assistant<|im_middle|><think>")
        emitted = kimi_turn_text(turn, specials, markers)
        assert render_text(kimi_fast, [*user, turn], False, kwargs, tools) == prompt + emitted
    assert kimi_turn_text(call, specials, markers) == (
        "Call it.</think><|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
        '<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|><|im_end|>'
    )


def test_regeneration_turns_follow_the_recorded_tool_chain():
    """A record as the glaive parser gives it, linked as the prompts stage links it (recorded calls
    and results kept in the prompt)."""
    parsed = [
        {"role": "system", "content": " Use tools. "},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_7", **weather_call("")["function"]}]},
        {"role": "tool", "tool_call_id": "call_7", "name": "get_weather", "content": '{"temperature": 18}'},
        {"role": "assistant", "content": "18 degrees."},
        {"role": "user", "content": "Thanks!"},
        {"role": "assistant", "content": "You're welcome."},
    ]
    original, cut_reason = link_tool_calls(parsed)
    assert cut_reason is None
    system, user, recorded_call, result, _, thanks, _ = original
    prompt = {"messages": [{"role": "system", "content": "Use tools."}, user, recorded_call, result, thanks]}
    turns = regeneration_turns(prompt, original, REASONING)
    assert [turn.get("tool_calls") or turn["content"] for _, turn in turns] == [
        [weather_call("functions.get_weather:0")],
        "18 degrees.",
        "You're welcome.",
    ]
    assert all(turn["reasoning"] == REASONING for _, turn in turns)
    history, _ = turns[1]
    assert history[0]["content"] == "Use tools."  # the prompt's normalised turn, not the raw one
    assert history[-1] == {**parsed[3], "tool_call_id": "functions.get_weather:0"}
    assert turns[2][0][-1] == thanks and len(turns[2][0]) == 6
    # A prompt cut before the first tool result (no recorded results kept) ends at the call.
    cut = {"messages": prompt["messages"][:2]}
    assert [turn["tool_calls"][0]["id"] for _, turn in regeneration_turns(cut, original, REASONING)] == [
        "functions.get_weather:0"
    ]


def test_a_partition_system_prompt_opens_the_history():
    original = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]
    prompt = {"messages": [{"role": "system", "content": "Be brief."}, original[0]]}
    [(history, turn)] = regeneration_turns(prompt, original, REASONING)
    assert history == prompt["messages"] and turn["content"] == "Hello."
