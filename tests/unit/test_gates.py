"""The tokens stage's quality gates on rows shaped as the responses stage writes them (`Conversation` fed
the `Turn`s that the OpenRouter and SGLang backends build), with real answers from tests/fixtures/realdata
and the real Kimi-K2.5 and Qwen3 tokenizers and templates, whose markers the gates read."""

import json

import pytest

from eagle3_datagen.backends.base import Turn, finish_reason
from eagle3_datagen.chat.gates import GATES, GateMarkers, console_line, repetition_rate
from eagle3_datagen.chat.template import resolve_special_tokens
from eagle3_datagen.chat.tool_calls import openai_call
from eagle3_datagen.formats.datasets import BadRecord, SkipRecord, parse
from eagle3_datagen.formats.files import read_json, read_jsonl, write_jsonl_zst
from eagle3_datagen.stages.prompts import build_prompts
from eagle3_datagen.stages.responses.conversation import Conversation
from eagle3_datagen.stages.responses.original import original_responses
from eagle3_datagen.stages.tokens import NothingTrained, TokenBuilder, finished_gates, run_tokens
from tests.helpers import defaults, token_settings
from tests.helpers.records import MANIFEST, REALDATA

KIMI_TOOL_MARKERS = (
    "<|tool_call_argument_begin|>",
    "<|tool_call_begin|>",
    "<|tool_call_end|>",
    "<|tool_calls_section_begin|>",
    "<|tool_calls_section_end|>",
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculate_factorial",
            "description": "Calculate the factorial of a given number",
            "parameters": {"type": "object", "properties": {"number": {"type": "integer"}}, "required": ["number"]},
        },
    }
]


def real_answers() -> list[tuple[str, str]]:
    """(file, answer) for every assistant answer with text in the real dataset records."""
    answers = []
    for name, fmt in MANIFEST:
        for line in (REALDATA / name).read_text().splitlines():
            try:
                _, parsed = parse(json.loads(line), fmt)
            except (BadRecord, SkipRecord):
                continue
            answers += [(name, m["content"]) for m in parsed.messages if m["role"] == "assistant" and m["content"]]
    return answers


ANSWERS = real_answers()
# A real answer of a few hundred words, healthy (ShareGPT's first record's longest).
HEALTHY = max((a for name, a in ANSWERS if name == "sharegpt_vicuna.jsonl"), key=len)
LAST_SENTENCE = HEALTHY.rstrip().rsplit(". ", 1)[-1]


def openrouter_turn(content="", reasoning="", raw_finish="stop", calls=None, **extra) -> Turn:
    """A turn as backends/openrouter.py builds it: the provider's raw finish reason in `produced_by`,
    the normalized one on the turn; `extra` (e.g. the provider's `refusal`) on the message."""
    return Turn(
        content=content,
        reasoning=reasoning,
        finish_reason=finish_reason(raw_finish != "length", calls),
        tool_calls=calls,
        usage={"prompt_tokens": 40, "completion_tokens": 200, "reasoning_tokens": 12, "cost": 0.0006},
        extra={
            **extra,
            "produced_by": {
                "backend": "openrouter",
                "provider": "Moonshot AI",
                "model": "moonshotai/kimi-k2.5",
                "attempts": 1,
                "finish_reason": raw_finish,
            },
        },
    )


def response_row(*turns: Turn, question="Tell me about it.", tools=None) -> dict:
    """The row the responses stage writes for a one-question prompt answered by `turns`."""
    messages = [{"role": "user", "content": question}]
    prompt = {"id": "p1", "source": {"file": "chats.jsonl", "line": 1}, "messages": messages}
    if tools:
        prompt["tools"] = tools
    conversation = Conversation(prompt)
    for turn in turns:
        conversation.add(turn)
    return conversation.row("openrouter", "moonshotai/kimi-k2.5")


@pytest.fixture(scope="module")
def kimi_builder(kimi_fast):
    def make(**gates):
        specials = resolve_special_tokens(kimi_fast)
        return TokenBuilder(kimi_fast, specials, token_settings(gates=gates))

    return make


def rows_per_gate() -> dict[str, dict]:
    """One row per gate that fails that gate alone."""
    bad_call = openai_call("calculate_factorial", '{"number": 5', 0)  # the provider's JSON, cut off
    markers_as_text = (
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.calculate_factorial:0"
        '<|tool_call_argument_begin|>{"number": 5}<|tool_call_end|><|tool_calls_section_end|>'
    )
    return {
        "truncated": response_row(openrouter_turn(HEALTHY[:300], "The user asks.", raw_finish="length")),
        "empty": response_row(openrouter_turn("", "The user asks; I will answer.")),
        # OpenRouter normalizes content_filter to a stop: only the raw reason tells.
        "content_filter": response_row(openrouter_turn(HEALTHY[:120], raw_finish="content_filter")),
        "refusal": response_row(openrouter_turn("I can't help with that.", refusal="I can't help with that request.")),
        "repetition": response_row(openrouter_turn(HEALTHY + (" " + LAST_SENTENCE) * 12)),
        # A provider that did not split the reasoning off: it stays in the content, closed by </think>.
        "reasoning_leak": response_row(openrouter_turn(f"The user asks about it.</think>{HEALTHY[:200]}")),
        "tool_call_syntax": response_row(
            openrouter_turn(calls=[bad_call], raw_finish="tool_calls"), question="Factorial of 5?", tools=TOOLS
        ),
        "tool_call_markers": response_row(openrouter_turn(markers_as_text), question="Factorial of 5?", tools=TOOLS),
    }


ROWS = rows_per_gate()


@pytest.mark.parametrize("case", list(ROWS))
def test_each_gate_drops_its_row_with_its_reason_and_trains_it_when_off(kimi_builder, case):
    gate = "tool_call_syntax" if case == "tool_call_markers" else case
    row = ROWS[case]
    builder = kimi_builder()
    assert builder.samples_for(row) == []
    gates = builder.report()["gates"]
    assert gates["dropped"] == {"p1": [gate]}
    assert gates["counts"] == {**dict.fromkeys((*GATES, "failed", "malformed"), 0), gate: 1}
    assert gates["rates"][gate] == 1.0 and gates["dropped_rows"] == 1
    off = {gate: False} if gate != "repetition" else {"repetition": {"enabled": False}}
    kept = kimi_builder(**off)
    assert len(kept.samples_for(row)) == 1
    assert gate in kept.report()["gates"]["off"] and gate not in kept.report()["gates"]["counts"]


def test_a_healthy_answer_a_tool_call_and_its_reply_pass_every_gate(kimi_builder):
    call = openai_call("calculate_factorial", '{"number": 5}', 0)
    rows = [
        response_row(openrouter_turn(HEALTHY, "The user shares a story; I answer it.")),
        {
            **response_row(
                openrouter_turn(calls=[call], raw_finish="tool_calls"), question="Factorial of 5?", tools=TOOLS
            ),
            "id": "p2",
        },
    ]
    builder = kimi_builder()
    assert [s["id"] for s in builder.samples_for_rows(rows)] == ["p1", "p2"]
    assert builder.report()["gates"]["dropped"] == {}


def test_failed_and_malformed_rows_are_listed_whatever_the_gates(kimi_builder):
    failed = {**response_row(), "status": "failed", "error": "HTTP 400: invalid request", "messages": []}
    # SGLang's reading of output IDs with a second think block: malformed, its raw reason a dict.
    malformed = response_row(
        Turn(
            content="Fine.</think>Fine.",
            reasoning="",
            finish_reason="stop",
            usage={},
            malformed="think_block",
            extra={"produced_by": {"backend": "sglang", "finish_reason": {"type": "stop", "matched": 163586}}},
        )
    )
    malformed["id"] = "p2"
    builder = kimi_builder(reasoning_leak=False)
    assert builder.samples_for_rows([failed, malformed]) == []
    assert builder.report()["gates"]["dropped"] == {"p1": ["failed"], "p2": ["malformed"]}


def test_markers_are_read_from_each_models_tokenizer_and_template(kimi_fast, kimi_slow, qwen_tokenizer):
    for tokenizer in (kimi_fast, kimi_slow):
        markers = GateMarkers.of(tokenizer, resolve_special_tokens(tokenizer))
        assert markers == GateMarkers(("<think>", "</think>"), KIMI_TOOL_MARKERS)
    # The demo's Qwen3 template writes no tool call: no tool-call markers, the arguments' JSON check alone.
    assert GateMarkers.of(qwen_tokenizer, resolve_special_tokens(qwen_tokenizer)) == GateMarkers(
        ("<think>", "</think>"), ()
    )


def test_qwen3_reasoning_leak(qwen_tokenizer):
    """Qwen3's think markers, from its tokenizer: a provider that left the think block in the content."""
    builder = TokenBuilder(qwen_tokenizer, resolve_special_tokens(qwen_tokenizer), token_settings())
    leaked = response_row(openrouter_turn(f"<think>\nThe user asks.\n</think>\n\n{HEALTHY[:200]}"))
    assert builder.samples_for(leaked) == []
    assert builder.report()["gates"]["dropped"] == {"p1": ["reasoning_leak"]}


def test_repetition_threshold_separates_real_answers_from_loops():
    """The calibration docs/report.md quotes: rep-4 over the last 256 words of every real answer in
    tests/fixtures/realdata that has 32 n-grams or more, against loops of the forms models fall into."""
    settings = defaults("tokens.gates.repetition")
    n, window, least, limit = (settings[k] for k in ("n", "window", "min_ngrams", "max_rate"))
    judged = sorted(rate for _, a in ANSWERS if (r := repetition_rate(a, n, window))[1] >= least for rate in [r[0]])
    assert len(judged) == 490
    assert judged[len(judged) // 2] == pytest.approx(0.004, abs=0.001)
    assert judged[-1] == pytest.approx(0.202, abs=0.001) and judged[-1] < limit
    loops = {
        "a phrase": "However I feel that the industrial pollution has been created and " + "it seems that " * 25,
        "two words": "Are there going to be exercises? " + "I think. " * 40,
        "a sentence and its variants": "I'll do it. I'll implement it. I'll start. I'll begin coding. " * 8,
        "the last sentence of a real answer": HEALTHY + (" " + LAST_SENTENCE) * 12,
        "Chinese": "这是一个很好的问题。" + "我们需要考虑这个问题。" * 12,
    }
    rates = {name: repetition_rate(text, n, window)[0] for name, text in loops.items()}
    assert min(rates.values()) > 0.7 > limit, rates


def test_every_real_records_own_answers_pass_every_gate(tmp_path, kimi_builder, kimi_fast):
    """The rows the `dataset` backend makes of every record in tests/fixtures/realdata (their own answers and
    tool calls, as the baseline twins train them), gated with Kimi-K2.5's markers: none is dropped."""
    specials = resolve_special_tokens(kimi_fast)
    builder = kimi_builder()
    for name, fmt in MANIFEST:
        prompts, out = tmp_path / f"{name}.prompts.jsonl.zst", tmp_path / f"{name}.jsonl.zst"
        build_prompts(REALDATA / name, fmt, [prompts], tmp_path / "prompt-stats.json")
        dataset = {"source": str(REALDATA / name), "format": fmt, "system_prompt": None}
        original_responses(prompts, out, tmp_path / "stats.json", dataset, (specials.think_start, specials.think_end))
        builder.samples_for_rows(read_jsonl(out))
    gates = builder.report()["gates"]
    assert (gates["rows"], gates["dropped_rows"]) == (325, 0)
    # rep-4 of the rows long enough to judge, in bins of 0.1: all far below max_rate (0.5)
    assert gates["repetition_rates"] == {"0.0": 161, "0.1": 20, "0.2": 1}


def test_the_console_line_and_a_partitions_finished_shards(tmp_path, kimi_fast_dir):
    """run_tokens on a shard of every gate's row and a healthy one: the audit lists the drops, the console
    line counts them, and a shard whose every row is dropped fails the job naming the reasons."""
    healthy = {**response_row(openrouter_turn(HEALTHY)), "id": "ok"}
    rows = [{**row, "id": case} for case, row in ROWS.items()] + [healthy]
    write_jsonl_zst(tmp_path / "responses.jsonl.zst", rows)
    tokens = tmp_path / "tokens"
    model = defaults("model")
    report = run_tokens(
        tmp_path / "responses.jsonl.zst", tokens / "00000.jsonl.zst", tokens / "00000.audit.json",
        kimi_fast_dir, model, token_settings(),
    )  # fmt: skip
    assert [s["id"] for s in read_jsonl(tokens / "00000.jsonl.zst")] == ["ok"]
    assert read_json(tokens / "00000.audit.json")["gates"]["dropped"] == {
        case: ["tool_call_syntax" if case == "tool_call_markers" else case] for case in ROWS
    }
    assert console_line("chat/00000", report["gates"]) == (
        "gates: chat/00000: 9 rows, 1 trained, 8 dropped (88.9%): truncated 1 (11.1%), empty 1 (11.1%), "
        "content_filter 1 (11.1%), refusal 1 (11.1%), repetition 1 (11.1%), reasoning_leak 1 (11.1%), "
        "tool_call_syntax 2 (22.2%)"
    )
    write_jsonl_zst(tmp_path / "gated.jsonl.zst", rows[:-1])
    with pytest.raises(NothingTrained, match=r"none of its 8 response rows is trained \(truncated 1, empty 1,"):
        run_tokens(
            tmp_path / "gated.jsonl.zst", tokens / "00001.jsonl.zst", tokens / "00001.audit.json",
            kimi_fast_dir, model, token_settings(),
        )  # fmt: skip
    assert not (tokens / "00001.jsonl.zst").exists()
    # An empty shard (a prompt shard without prompts) is not a failure: nothing came in.
    write_jsonl_zst(tmp_path / "none.jsonl.zst", [])
    run_tokens(
        tmp_path / "none.jsonl.zst", tokens / "00002.jsonl.zst", tokens / "00002.audit.json",
        kimi_fast_dir, model, token_settings(),
    )  # fmt: skip
    so_far = finished_gates(tokens)
    assert (so_far["shards"], so_far["rows"], so_far["dropped_rows"], so_far["counts"]["tool_call_syntax"]) == (
        2, 9, 8, 2,
    )  # fmt: skip


def test_a_repetition_gate_that_could_judge_no_text_is_refused_before_any_job():
    from eagle3_datagen.workflow.config_checks import gate_problems

    config = {"tokens": defaults("tokens")}
    assert gate_problems(config) == []
    config["tokens"]["gates"]["repetition"].update(window=16, min_ngrams=32)
    assert gate_problems(config) == [
        "tokens.gates.repetition: a window of 16 words holds 13 4-grams, fewer than min_ngrams 32, so no text "
        "would be judged; raise window or lower min_ngrams (or set enabled: false)"
    ]
    config["tokens"]["gates"]["repetition"]["enabled"] = False
    assert gate_problems(config) == []
