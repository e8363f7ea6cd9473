"""Tool calls regenerated natively, on Kimi-K2.5's real tokenizer and template: the markers, the chain
of calls and recorded results through the SGLang, OpenRouter and hf backends, a Glaive record."""

import pytest

from eagle3_datagen.chat.template import TemplateError
from eagle3_datagen.chat.tool_calls import ToolCallMarkers, derive_markers, openai_call
from eagle3_datagen.formats.files import read_jsonl, write_jsonl_zst
from tests.doubles.loopback import Loopback, ScriptedCall, serve_in_thread
from tests.helpers import defaults, openrouter_backend, run_responses, sglang_backend
from tests.helpers.records import GLAIVE_CHAIN, write_jsonl

FACTORIAL = {
    "type": "function",
    "function": {
        "name": "calculate_factorial",
        "description": "Calculate the factorial of a number",
        "parameters": {"type": "object", "properties": {"number": {"type": "integer"}}, "required": ["number"]},
    },
}


def recorded_call(name, arguments, index, result=None):
    """A prompt's recorded tool-call turn, and its recorded result when given."""
    call = openai_call(name, arguments, index)
    messages = [{"role": "assistant", "content": "", "tool_calls": [call]}]
    if result is not None:
        messages.append({"role": "tool", "tool_call_id": call["id"], "name": name, "content": result})
    return messages


def tool_prompts(tmp_path):
    user = {"role": "user", "content": "Factorial of 5?"}
    rows = [
        # the model's call equals the recorded one as JSON (the spacing differs): its result is reused
        [
            user,
            *recorded_call("calculate_factorial", '{"number":5}', 0, '{"result": 120}'),
            {"role": "user", "content": "Thanks"},
        ],
        [
            {"role": "user", "content": "Factorial of 6?"},
            *recorded_call("calculate_factorial", '{"number":6}', 0, "720"),
        ],
        [user, *recorded_call("calculate_factorial", '{"number":5}', 0)],  # no recorded result
        [{"role": "user", "content": "Factorial of 8, quickly"}],  # the record answered without a call
        [{"role": "user", "content": "Hello there"}],
    ]
    prompts = [
        {"id": f"t{i}", "source": "test", "messages": m, **({"tools": [FACTORIAL]} if i < 4 else {})}
        for i, m in enumerate(rows)
    ]
    path = tmp_path / "tools.jsonl.zst"
    write_jsonl_zst(path, prompts)
    return path


TOOL_SCRIPT = [
    ScriptedCall("Factorial of 5", "calculate_factorial", '{"number": 5}'),
    ScriptedCall("Factorial of 6", "calculate_factorial", '{"number": 7}'),
    ScriptedCall("Factorial of 8", "calculate_factorial", '{"number": 8}'),
]


def test_kimi_tool_call_markers_come_from_the_template_and_parse_like_sglang(kimi_fast):
    markers = derive_markers(kimi_fast)
    assert markers == ToolCallMarkers(
        "<|tool_calls_section_begin|>",
        "<|tool_calls_section_end|>",
        "<|tool_call_begin|>",
        "<|tool_call_argument_begin|>",
        "<|tool_call_end|>",
    )
    # each marker is one token of the real vocabulary, not a special one
    for marker, token_id in zip(vars(markers).values(), (163595, 163596, 163597, 163598, 163599), strict=True):
        assert kimi_fast(marker, add_special_tokens=False)["input_ids"] == [token_id]
        assert not kimi_fast.added_tokens_decoder[token_id].special
    output = (
        "Let me check. <|tool_calls_section_begin|><|tool_call_begin|> functions.calculate_factorial:7 "
        '<|tool_call_argument_begin|>{"number": 5}<|tool_call_end|><|tool_call_begin|>lookup:0'
        '<|tool_call_argument_begin|>{"q": "x"}<|tool_call_end|><|tool_calls_section_end|>'
    )
    content, calls = markers.split(output, [FACTORIAL], first_index=2)
    assert content == "Let me check. "
    # SGLang numbers calls after the history's, whatever index the model wrote
    assert calls == [
        openai_call("calculate_factorial", '{"number": 5}', 2),
        openai_call("lookup", '{"q": "x"}', 3),
    ]
    bare = "<|tool_calls_section_begin|><|tool_call_begin|>0<|tool_call_argument_begin|>{}<|tool_call_end|>"
    assert markers.split(bare, [FACTORIAL], 0)[1] == [openai_call("calculate_factorial", "{}", 0)]
    assert markers.split("<|tool_calls_section_begin|>oops", [FACTORIAL], 0) == ("<|tool_calls_section_begin|>oops", [])
    assert markers.split("No calls.", [FACTORIAL], 0) == ("No calls.", None)
    assert markers.render([("f", "{}")], 4) == (
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:4<|tool_call_argument_begin|>{}"
        "<|tool_call_end|><|tool_calls_section_end|>"
    )


def test_a_template_without_kimi_style_calls_refuses_prompts_with_tools(qwen_tokenizer):
    from eagle3_datagen.backends.rendered import ToolCallReader
    from eagle3_datagen.chat.families.target_chat import Family

    reader = ToolCallReader(qwen_tokenizer, {}, Family())  # the demo's Qwen3-style template is generic
    reader.check(None)  # prompts without tools are served as before
    with pytest.raises(TemplateError, match="declares tools, but the chat template does not write a tool call"):
        reader.check([FACTORIAL])


def test_sglang_tool_chain_reuses_matching_results_and_ends_where_calls_differ(tmp_path, kimi_fast_dir, kimi_fast):
    server = Loopback(str(kimi_fast_dir), tokenizer=kimi_fast, tool_script=TOOL_SCRIPT)
    with serve_in_thread(server) as url:
        stats = run_responses(tmp_path, tool_prompts(tmp_path), sglang_backend(kimi_fast_dir, url))
    matched, diverged, missing, unrecorded, plain = read_jsonl(tmp_path / "out.jsonl.zst")

    call = openai_call("calculate_factorial", '{"number": 5}', 0)
    assert [m["role"] for m in matched["messages"]] == ["user", "assistant", "tool", "assistant", "user", "assistant"]
    called, result, answer = matched["messages"][1:4]
    assert called["tool_calls"] == [call] and called["finish_reason"] == "tool_calls"
    assert called["content"] == "" and called["reasoning"] == "Considering it."
    assert kimi_fast.decode(called["output_ids"]) == (
        "Considering it.</think><|tool_calls_section_begin|><|tool_call_begin|>functions.calculate_factorial:0"
        '<|tool_call_argument_begin|>{"number": 5}<|tool_call_end|><|tool_calls_section_end|><|im_end|>'
    )
    assert result == {
        "role": "tool",
        "tool_call_id": "functions.calculate_factorial:0",
        "name": "calculate_factorial",
        "content": '{"result": 120}',
    }
    assert answer["finish_reason"] == "stop" and answer["content"].startswith("Answer ") and "tool_calls" not in answer
    assert [m["turn"] for m in matched["messages"] if m["role"] == "assistant"] == [0, 1, 2]
    assert matched["status"] == "ok" and "ended" not in matched and matched["tools"] == [FACTORIAL]

    # the model saw the tools declared, its own call and the reused result, rendered by K2.5's template
    after_result = next(p for p in server.generate_prompts if "## Return of" in p and "Factorial of 5" in p)
    assert after_result.startswith(
        '<|im_system|>tool_declare<|im_middle|>[{"type":"function","function":{"name":"calculate_factorial"'
    )
    assert after_result.endswith(
        # the reasoning of the call turn stays in the chain, as K2.5's template keeps it
        "<|im_assistant|>assistant<|im_middle|><think>Considering it.</think><|tool_calls_section_begin|>"
        '<|tool_call_begin|>functions.calculate_factorial:0<|tool_call_argument_begin|>{"number": 5}'
        "<|tool_call_end|><|tool_calls_section_end|><|im_end|>"
        "<|im_system|>calculate_factorial<|im_middle|>## Return of functions.calculate_factorial:0\n"
        '{"result": 120}<|im_end|><|im_assistant|>assistant<|im_middle|><think>'
    )

    for row, ended in (
        (diverged, "tool_call_diverged"),
        (missing, "tool_result_missing"),
        (unrecorded, "tool_call_unrecorded"),
    ):
        assert row["status"] == "ok" and row["ended"] == ended
        assert row["messages"][-1]["role"] == "assistant" and row["messages"][-1]["finish_reason"] == "tool_calls"
    assert diverged["messages"][-1]["tool_calls"] == [openai_call("calculate_factorial", '{"number": 7}', 0)]
    assert "tools" not in plain and "tool_call_counts" not in plain and plain["messages"][-1]["finish_reason"] == "stop"
    assert not any("tool_declare" in p for p in server.generate_prompts if "Hello there" in p)

    assert stats["tool_calls"] == {
        "regenerated": 4,
        "matched": 2,
        "diverged": 2,
        "results_reused": 1,
        "recorded_not_called": 0,
    }
    assert stats["ended"] == {"tool_call_diverged": 1, "tool_result_missing": 1, "tool_call_unrecorded": 1}
    assert stats["finish_reasons"] == {"tool_calls": 4, "stop": 3}


def test_openrouter_declares_tools_and_stores_its_calls_with_kimi_ids(tmp_path, api_key):
    server = Loopback("unused", api_key=api_key, tool_script=TOOL_SCRIPT)
    prompts = tmp_path / "p.jsonl.zst"
    user = {"role": "user", "content": "Factorial of 5?"}
    history = [{"role": "user", "content": "Warm-up"}, *recorded_call("noop", "{}", 0, "ok")]
    messages = [*history, user, *recorded_call("calculate_factorial", '{"number": 5}', 1, "120")]
    write_jsonl_zst(prompts, [{"id": "o1", "source": "test", "tools": [FACTORIAL], "messages": messages}])
    with serve_in_thread(server) as url:
        stats = run_responses(tmp_path, prompts, openrouter_backend(url))
    [row] = read_jsonl(tmp_path / "out.jsonl.zst")
    # the warm-up turn answers in text: its recorded call is counted as not made
    assert [m["role"] for m in row["messages"]] == ["user", "assistant", "user", "assistant", "tool", "assistant"]
    called = row["messages"][3]
    # the provider's "call_..." id is replaced by Kimi's, numbered after the history's calls
    assert called["tool_calls"] == [openai_call("calculate_factorial", '{"number": 5}', 0)]
    assert called["finish_reason"] == "tool_calls" and called["content"] == ""
    assert row["messages"][4]["tool_call_id"] == "functions.calculate_factorial:0"
    sent = server.last_chat_request
    assert sent["tools"] == [FACTORIAL]
    assert sent["messages"][-2:] == [
        {"role": "assistant", "content": "", "tool_calls": [openai_call("calculate_factorial", '{"number": 5}', 0)]},
        {
            "role": "tool",
            "content": "120",
            "tool_call_id": "functions.calculate_factorial:0",
            "name": "calculate_factorial",
        },
    ]
    assert stats["tool_calls"]["recorded_not_called"] == 1 and stats["tool_calls"]["results_reused"] == 1


def test_hf_backend_declares_tools_and_goes_on_after_a_matched_call(tmp_path, kimi_fast_dir, kimi_fast):
    """The hf backend on Kimi-K2.5's tokenizer and template, with a tiny random Qwen3 as the model.

    A random model cannot be made to call a tool, so `lm.generate` is replaced by one that
    answers the rendered prompt with fixed output IDs (a call after a user turn, a text answer
    after a tool result). The rendering with tools, the output parsing and the loop are real.
    """
    import shutil

    import torch

    from eagle3_datagen.backends.hf.generate import HFBackend
    from tests.helpers import tiny_qwen3

    kimi_tiny_dir = tmp_path / "Kimi-tiny"
    shutil.copytree(kimi_fast_dir, kimi_tiny_dir)
    torch.manual_seed(0)
    tiny_qwen3(len(kimi_fast), num_layers=1).save_pretrained(kimi_tiny_dir)
    backend = HFBackend(
        kimi_tiny_dir,
        defaults("inference.sampling", max_new_tokens=64),
        defaults("inference.hf", batch_size=2),
        defaults("model"),
    )
    markers = derive_markers(kimi_fast)
    seen = []

    def scripted_generate(input_ids, attention_mask, **kwargs):
        rows = []
        for ids, mask in zip(input_ids.tolist(), attention_mask.tolist(), strict=True):
            prompt = kimi_fast.decode([i for i, m in zip(ids, mask, strict=True) if m])
            seen.append(prompt)
            if "## Return of" in prompt.rsplit("<|im_user|>", 1)[-1]:
                text = "Got it.</think>It is 120.<|im_end|>"
            else:
                text = "Compute it.</think>" + markers.render([("calculate_factorial", '{"number": 5}')]) + "<|im_end|>"
            rows.append(ids + kimi_fast(text, add_special_tokens=False)["input_ids"])
        width = max(map(len, rows))
        return torch.tensor([r + [kimi_fast.pad_token_id] * (width - len(r)) for r in rows])

    backend.lm.generate = scripted_generate
    prompt = {
        "id": "h1",
        "source": "test",
        "tools": [FACTORIAL],
        "messages": [
            {"role": "user", "content": "Factorial of 5?"},
            *recorded_call("calculate_factorial", '{"number":5}', 0, "120"),
        ],
    }
    write_jsonl_zst(tmp_path / "h.jsonl.zst", [prompt])
    run_responses(tmp_path, tmp_path / "h.jsonl.zst", backend)
    [row] = read_jsonl(tmp_path / "out.jsonl.zst")
    assert [m["role"] for m in row["messages"]] == ["user", "assistant", "tool", "assistant"]
    called, result, answer = row["messages"][1:]
    assert called["tool_calls"] == [openai_call("calculate_factorial", '{"number": 5}', 0)]
    assert called["finish_reason"] == "tool_calls" and called["reasoning"] == "Compute it."
    assert result["tool_call_id"] == "functions.calculate_factorial:0" and result["content"] == "120"
    assert (answer["reasoning"], answer["content"], answer["finish_reason"]) == ("Got it.", "It is 120.", "stop")
    assert all(p.startswith("<|im_system|>tool_declare<|im_middle|>") for p in seen) and len(seen) == 2
    assert row["tool_call_counts"] == {"regenerated": 1, "matched": 1, "results_reused": 1}


def test_a_glaive_record_is_regenerated_with_its_recorded_results(tmp_path, kimi_fast_dir, kimi_fast):
    from eagle3_datagen.stages.prompts import build_prompts

    prompts = tmp_path / "prompts.jsonl.zst"
    build_prompts(write_jsonl(tmp_path / "glaive.jsonl", [GLAIVE_CHAIN]), "glaive", [prompts], tmp_path / "p.json")
    script = [
        ScriptedCall("factorial of 5", "calculate_factorial", '{"number": 5}'),
        ScriptedCall("news for the United States", "get_news_headlines", '{"country": "United States"}'),
    ]
    with serve_in_thread(Loopback(str(kimi_fast_dir), tokenizer=kimi_fast, tool_script=script)) as url:
        stats = run_responses(tmp_path, prompts, sglang_backend(kimi_fast_dir, url))
    [row] = read_jsonl(tmp_path / "out.jsonl.zst")
    assert [m["role"] for m in row["messages"]] == [
        *("system", "user", "assistant", "tool", "assistant"),
        *("user", "assistant", "tool", "assistant"),
        *("user", "assistant"),
    ]
    calls = [m["tool_calls"][0] for m in row["messages"] if m.get("tool_calls")]
    assert [c["id"] for c in calls] == ["functions.calculate_factorial:0", "functions.get_news_headlines:1"]
    results = [(m["tool_call_id"], m["content"]) for m in row["messages"] if m["role"] == "tool"]
    assert results == [
        ("functions.calculate_factorial:0", '{"result": 120}'),
        ("functions.get_news_headlines:1", '{"headlines": ["A", "B"]}'),
    ]
    assert row["status"] == "ok" and "ended" not in row and len(row["tools"]) == 2
    assert stats["tool_calls"] == {
        "regenerated": 2,
        "matched": 2,
        "diverged": 0,
        "results_reused": 2,
        "recorded_not_called": 0,
    }


def test_calls_match_by_function_and_arguments_as_json_values():
    from eagle3_datagen.chat.tool_calls import same_call

    recorded = openai_call("f", '{"b":[1,true],"a":5}', 3)
    assert same_call(openai_call("f", '{"a": 5.0, "b": [1, true]}', 0), recorded)  # order, spacing, 5 == 5.0
    assert not same_call(openai_call("f", '{"a": 5, "b": [1, 1]}', 0), recorded)  # true is not 1
    assert not same_call(openai_call("g", '{"b":[1,true],"a":5}', 0), recorded)
    assert not same_call(openai_call("f", "{not json", 0), openai_call("f", "{not json", 0))
