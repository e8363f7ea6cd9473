"""The tokens stage's quality gates on rows shaped as the responses stage writes them (`Conversation` fed
the `Turn`s that the OpenRouter and SGLang backends build), with real answers from tests/fixtures/realdata
and the real Kimi-K2.5 and Qwen3 tokenizers and templates, whose markers the gates read."""

import json

import pytest

from eagle3_datagen.backends.base import Turn, finish_reason
from eagle3_datagen.chat.gates import GATES, GateMarkers, console_line, loop_share
from eagle3_datagen.chat.template import resolve_special_tokens
from eagle3_datagen.chat.tool_calls import openai_call
from eagle3_datagen.formats.datasets import BadRecord, SkipRecord, parse
from eagle3_datagen.formats.files import read_json, read_jsonl, write_jsonl_zst
from eagle3_datagen.stages.prompts import build_prompts
from eagle3_datagen.stages.responses.conversation import Conversation
from eagle3_datagen.stages.responses.original import original_responses
from eagle3_datagen.stages.tokens import GateRateExceeded, NothingTrained, TokenBuilder, finished_gates, run_tokens
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


# DeepSeek-R1 served without its reasoning parser (canonical/inference-snaps#104): the reasoning opens the
# content, its think block's start in the prompt, its end cut by the engine.
REASONING_LEFT_IN_CONTENT = (
    'Okay, so the user said "hello". That\'s a friendly greeting. I should respond in a warm and welcoming way.'
)
HERMES_CALL_AS_TEXT = '<tool_call>\n{"name": "calculate_factorial", "arguments": {"number": 5}}\n</tool_call>'


def rows_per_gate() -> dict[str, dict]:
    """One row per gate that fails that gate alone."""
    bad_call = openai_call("calculate_factorial", '{"number": 5', 0)  # the provider's JSON, cut off
    markers_as_text = (
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.calculate_factorial:0"
        '<|tool_call_argument_begin|>{"number": 5}<|tool_call_end|><|tool_calls_section_end|>'
    )
    thought = "The user asks; I answer."
    return {
        "truncated": response_row(openrouter_turn(HEALTHY[:300], "The user asks.", raw_finish="length")),
        "empty": response_row(openrouter_turn("", "The user asks; I will answer.")),
        # OpenRouter normalizes content_filter to a stop: only the raw reason tells.
        "content_filter": response_row(openrouter_turn(HEALTHY[:120], thought, raw_finish="content_filter")),
        "refusal": response_row(
            openrouter_turn("I can't help with that.", thought, refusal="I can't help with that request.")
        ),
        "repetition": response_row(openrouter_turn(HEALTHY + (" " + LAST_SENTENCE) * 12, thought)),
        # A provider that did not split the reasoning off: it stays in the content, closed by </think>.
        "reasoning_leak": response_row(openrouter_turn(f"The user asks about it.</think>{HEALTHY[:200]}")),
        # Kimi-K2.5's template opens a think block for every answer: one without reasoning was not split.
        "reasoning_missing": response_row(openrouter_turn(HEALTHY[:300])),
        "reasoning_in_content": response_row(
            openrouter_turn(f"{REASONING_LEFT_IN_CONTENT}\n\n{HEALTHY[:200]}", thought)
        ),
        "tool_call_syntax": response_row(
            openrouter_turn(calls=[bad_call], raw_finish="tool_calls"), question="Factorial of 5?", tools=TOOLS
        ),
        "tool_call_markers": response_row(
            openrouter_turn(markers_as_text, thought), question="Factorial of 5?", tools=TOOLS
        ),
        # Hermes' text layout for a call, which Kimi-K2.5's template writes with its own tokens.
        "tool_call_as_text": response_row(
            openrouter_turn(HERMES_CALL_AS_TEXT, thought), question="Factorial of 5?", tools=TOOLS
        ),
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
        specials = resolve_special_tokens(tokenizer)
        # Kimi-K2.5's generation prompt opens a think block: it reasons before every answer...
        assert GateMarkers.of(tokenizer, specials) == GateMarkers(("<think>", "</think>"), KIMI_TOOL_MARKERS, True)
        # ...unless `thinking=False` closes it empty.
        assert not GateMarkers.of(tokenizer, specials, {"thinking": False}).thinking
    # The demo's Qwen3 template writes no tool call: no tool-call markers, the arguments' JSON check alone; its
    # prompt opens no think block, so reasoning is judged missing only where enable_thinking switches it on.
    specials = resolve_special_tokens(qwen_tokenizer)
    assert GateMarkers.of(qwen_tokenizer, specials) == GateMarkers(("<think>", "</think>"), (), False)
    assert GateMarkers.of(qwen_tokenizer, specials, {"enable_thinking": True}).thinking
    assert not GateMarkers.of(qwen_tokenizer, specials, {"enable_thinking": False}).thinking


def test_qwen3_reasoning_leak(qwen_tokenizer):
    """Qwen3's think markers, from its tokenizer: a provider that left the think block in the content."""
    builder = TokenBuilder(qwen_tokenizer, resolve_special_tokens(qwen_tokenizer), token_settings())
    leaked = response_row(openrouter_turn(f"<think>\nThe user asks.\n</think>\n\n{HEALTHY[:200]}"))
    assert builder.samples_for(leaked) == []
    assert builder.report()["gates"]["dropped"] == {"p1": ["reasoning_leak"]}


LOOPS = {
    "a phrase": "However I feel that the industrial pollution has been created and " + "it seems that " * 25,
    "two words": "Are there going to be exercises? " + "I think. " * 40,
    "a sentence and its variants": "I'll do it. I'll implement it. I'll start. I'll begin coding. " * 8,
    "the last sentence of a real answer": HEALTHY + (" " + LAST_SENTENCE) * 12,
    "Chinese": "这是一个很好的问题。" + "我们需要考虑这个问题。" * 12,
    # a period of 200 words, past the 128 that rep-4 over 256 words could see (it measured 0.25)
    "a paragraph written three times": "Let me summarise the story. " + (" ".join(HEALTHY.split()[:200]) + " ") * 3,
}
# Structured answers that repeat their keys on every line with new values: rep-4 over 256 words, the
# measure before, took both for loops (0.54 and 0.54, above its 0.5).
SQL_INSERTS = (
    "Here are 60 rows of sample data:\n\n```sql\n"
    + "\n".join(
        f"INSERT INTO users (id, name, email, active) VALUES ({i}, 'user{i}', 'user{i}@example.com', true);"
        for i in range(1, 61)
    )
    + "\n```\n"
)
KUBERNETES_SERVICES = (
    "```yaml\n"
    + "".join(
        f"---\napiVersion: v1\nkind: Service\nmetadata:\n  name: service-{i}\n  namespace: production\n  labels:\n"
        f"    app: service-{i}\n    tier: backend\nspec:\n  type: ClusterIP\n  selector:\n    app: service-{i}\n"
        "  ports:\n    - name: http\n      protocol: TCP\n      port: 80\n      targetPort: 8080\n"
        for i in range(1, 31)
    )
    + "```\n"
)


def test_repetition_threshold_separates_real_answers_from_loops():
    """The calibration docs/report.md quotes: the loop share of the last 256 words of every real answer in
    tests/fixtures/realdata with 32 words or more, against loops of the forms models fall into."""
    settings = defaults("tokens.gates.repetition")
    window, period, least, limit = (settings[k] for k in ("window", "max_period", "min_words", "max_rate"))
    judged = sorted(r for _, a in ANSWERS if (m := loop_share(a, window, period))[1] >= least for r in [m[0]])
    assert len(judged) == 496
    assert judged[len(judged) // 2] == pytest.approx(0.032, abs=0.001)
    assert judged[-1] == pytest.approx(0.216, abs=0.001) and judged[-1] < limit
    rates = {name: loop_share(text, window, period)[0] for name, text in LOOPS.items()}
    assert min(rates.values()) > 0.75 > limit, rates
    assert rates["a paragraph written three times"] == 1.0
    structured = {name: loop_share(text, window, period)[0] for name, text in (
        ("sql", SQL_INSERTS), ("yaml", KUBERNETES_SERVICES)
    )}  # fmt: skip
    assert structured == pytest.approx({"sql": 0.043, "yaml": 0.063}, abs=0.001)


def test_sql_inserts_and_kubernetes_services_are_trained_and_a_long_period_loop_is_not(kimi_builder):
    thought = "The user asks for data; I write it."
    rows = {
        "sql": response_row(openrouter_turn(SQL_INSERTS, thought), question="Sample data for users, 60 rows?"),
        "yaml": response_row(openrouter_turn(KUBERNETES_SERVICES, thought), question="30 services?"),
        "loop": response_row(openrouter_turn(LOOPS["a paragraph written three times"], thought)),
    }
    builder = kimi_builder()
    builder.samples_for_rows([{**row, "id": name} for name, row in rows.items()])
    assert builder.report()["gates"]["dropped"] == {"loop": ["repetition"]}


def code_dataset_answers() -> dict[str, list[str]]:
    """Per code or tool-call dataset of tests/fixtures/realdata (the same files as shared/fixtures/realdata),
    every assistant answer as its format reader gives it: content, and each tool call as JSON text."""
    answers: dict[str, list[str]] = {}
    for name, fmt in MANIFEST:
        if not name.startswith(CODE_AND_TOOL_DATASETS):
            continue
        for line in (REALDATA / name).read_text().splitlines():
            try:
                _, parsed = parse(json.loads(line), fmt)
            except (BadRecord, SkipRecord):
                continue
            for m in parsed.messages:
                if m["role"] == "assistant":
                    texts = [m["content"], *(json.dumps(c) for c in m.get("tool_calls") or ())]
                    answers.setdefault(name, []).extend(t for t in texts if t)
    return answers


CODE_AND_TOOL_DATASETS = (
    "magicoder_", "evol_instruct_code", "code_feedback", "codefeedback_", "python_code", "glaive_", "xlam_",
    "apigen_", "hermes_function", "toolace",
)  # fmt: skip


def test_the_gates_drop_no_real_code_or_tool_call_answer(kimi_builder):
    """The false-positive rate docs/report.md states, per dataset: every code and tool-call answer of the real
    records as a row's answer (with reasoning, as Kimi-K2.5 gives it), through every gate: (answers, of them
    long enough for the loop measure, dropped)."""
    measured = {}
    for name, texts in code_dataset_answers().items():
        builder = kimi_builder()
        rows = [
            {**response_row(openrouter_turn(t, "The user asks; I answer.")), "id": str(i)} for i, t in enumerate(texts)
        ]
        builder.samples_for_rows(rows)
        gates = builder.report()["gates"]
        judged = sum(gates["repetition_rates"].values())
        measured[name] = (gates["rows"], judged, gates["dropped_rows"])
    assert measured == {
        "glaive_function_calling_v2.jsonl": (8, 0, 0),
        "glaive_toolcall_llamafactory.jsonl": (964, 451, 0),
        "python_code_23k_sharegpt.jsonl": (1, 1, 0),
        "hermes_function_calling_v1.jsonl": (4, 2, 0),
        "toolace.jsonl": (5, 3, 0),
        "code_feedback.jsonl": (2, 2, 0),
        "magicoder_evol_instruct_110k.jsonl": (1, 1, 0),
        "magicoder_oss_instruct_75k.jsonl": (1, 1, 0),
        "evol_instruct_code_80k.jsonl": (1, 1, 0),
        "codefeedback_filtered_instruction.jsonl": (1, 1, 0),
        "xlam_function_calling_60k.jsonl": (4, 0, 0),
        "apigen_function_calling.jsonl": (2, 0, 0),
    }


def test_think_tags_quoted_as_code_are_not_a_leak_a_stray_one_is(kimi_builder):
    """An answer about parsing think tags quotes them in backticks or a fenced block; the model's own
    marker written as text (a `</think>` closing a block it never opened) is still a leak."""
    thought = "The user asks how to strip think tags; a regex does it."
    about_tags = (
        "Reasoning models wrap their thoughts in `<think>` and `</think>`. Strip them with a regex:\n\n"
        "```python\nimport re\n\ndef strip_think(text: str) -> str:\n"
        '    return re.sub(r"<think>.*?</think>", "", text, flags=re.S).strip()\n```\n\n'
        "The `re.S` flag lets `.` match newlines inside the block."
    )
    rows = [
        {**response_row(openrouter_turn(about_tags, thought)), "id": "quoted"},
        {**response_row(openrouter_turn("Paris.</think>The capital of France is Paris.", thought)), "id": "stray"},
        {**response_row(openrouter_turn("Wrap it as `x`.</think>Done: `<think>` is the tag.", thought)), "id": "both"},
    ]
    builder = kimi_builder()
    assert [s["id"] for s in builder.samples_for_rows(rows)] == ["quoted"]
    assert builder.report()["gates"]["dropped"] == {"stray": ["reasoning_leak"], "both": ["reasoning_leak"]}


# Refusals as the providers' models word them: OpenAI's structured-outputs guide, Llama 3.1's safety tuning,
# Kimi's and Claude's short declines, a Chinese one.
REFUSALS = [
    "I'm sorry, but I can't assist with that.",
    "I'm sorry, I cannot assist with that request.",
    "I can't fulfill that request.",
    "I can't provide information or guidance on illegal or harmful activities. Can I help you with something else?",
    "I'm sorry, but I can't help with that request.",
    "I can’t help with that.",
    "抱歉，我无法提供这方面的帮助。",
]
NOT_REFUSALS = [
    # Glaive's tool-use answer (tests/fixtures/realdata/glaive_toolcall_llamafactory.jsonl): a limit explained
    "I'm sorry, but I can't assist with that. My current capabilities allow me to create calendar events. "
    "Ordering a pizza is an external task that I don't have the function for.",
    "I can't browse the internet, but here is what I know about the 2020 election results: ...",
    "I'm sorry to hear that your build fails. The error says the module is missing; install it with pip.",
    "I cannot stress this enough: back up your data before you upgrade.",
]


def test_a_refusal_in_the_answers_text_is_caught(kimi_builder):
    thought = "The user asks for something; I decide."
    rows = [{**response_row(openrouter_turn(t, thought)), "id": f"r{i}"} for i, t in enumerate(REFUSALS)]
    rows += [{**response_row(openrouter_turn(t, thought)), "id": f"ok{i}"} for i, t in enumerate(NOT_REFUSALS)]
    builder = kimi_builder()
    assert [s["id"] for s in builder.samples_for_rows(rows)] == [f"ok{i}" for i in range(len(NOT_REFUSALS))]
    assert builder.report()["gates"]["dropped"] == {f"r{i}": ["refusal"] for i in range(len(REFUSALS))}


def test_reasoning_written_as_the_answer_is_caught(kimi_builder):
    """Real answers whose reasoning the provider left in the content: DeepSeek-R1 without its reasoning
    parser (canonical/inference-snaps#104), DeepSeek-V4's raw completion (its issue #16), Kimi's "The user
    is asking" opening; with no reasoning field, reasoning is missing as well. Answers that mention a user
    are trained."""
    leaked = [
        REASONING_LEFT_IN_CONTENT + ' Maybe say something like, "Hello! How can I assist you today?"\n\nHello!',
        "1.  The user asks for the product of 17 and 23…\n3.  Provide the answer briefly.\n\n391",
        "The user is asking about the capital of France. I should answer directly.\n\nThe capital is Paris.",
    ]
    fine = [
        "The user interface is built with React; the state lives in a Redux store.",
        "The user is prompted to enter a number, and the program prints its factorial.",
        "Okay, let me know if you need the code in another language.",
    ]
    rows = [{**response_row(openrouter_turn(t)), "id": f"leak{i}"} for i, t in enumerate(leaked)]
    rows += [
        {**response_row(openrouter_turn(t, "The user asks; I answer.")), "id": f"ok{i}"} for i, t in enumerate(fine)
    ]
    builder = kimi_builder()
    assert [s["id"] for s in builder.samples_for_rows(rows)] == ["ok0", "ok1", "ok2"]
    assert builder.report()["gates"]["dropped"] == {
        f"leak{i}": ["reasoning_missing", "reasoning_in_content"] for i in range(len(leaked))
    }


def test_a_tool_call_written_as_text_is_caught_where_tools_were_offered(kimi_builder):
    """Calls as Llama 3.1 (`parameters`), Glaive (`<functioncall>`) and Hermes (`<tool_call>`) write them, in the
    content of a turn that was offered the tool; the same text without the tool offered, and an answer that
    quotes the tool's declaration, are trained."""
    thought = "The user wants 5!; I call the tool."
    as_text = [
        '{"name": "calculate_factorial", "parameters": {"number": 5}}',
        '<functioncall> {"name": "calculate_factorial", "arguments": \'{"number": 5}\'}',
        HERMES_CALL_AS_TEXT,
        'Let me compute it.\n```json\n[{"type": "function", "function": {"name": "calculate_factorial", '
        '"arguments": "{\\"number\\": 5}"}}]\n```',
    ]
    declaration = "The tool is declared as:\n" + json.dumps(TOOLS[0]["function"]) + "\nIt takes one integer."
    rows = [
        {**response_row(openrouter_turn(t, thought), question="Factorial of 5?", tools=TOOLS), "id": f"t{i}"}
        for i, t in enumerate(as_text)
    ]
    rows += [
        {**response_row(openrouter_turn(as_text[0], thought), question="Factorial of 5?"), "id": "no_tools"},
        {**response_row(openrouter_turn(declaration, thought), question="Which tools?", tools=TOOLS), "id": "decl"},
    ]
    builder = kimi_builder()
    assert [s["id"] for s in builder.samples_for_rows(rows)] == ["no_tools", "decl"]
    assert builder.report()["gates"]["dropped"] == {f"t{i}": ["tool_call_as_text"] for i in range(len(as_text))}


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
    # the loop share of the rows long enough to judge, in bins of 0.1: all far below max_rate (0.5)
    assert gates["repetition_rates"] == {"0.0": 173, "0.1": 12, "0.2": 1}


def test_the_console_line_and_a_partitions_finished_shards(tmp_path, kimi_fast_dir):
    """run_tokens on a shard of every gate's row and a healthy one: the audit lists the drops, the console
    line counts them, and a shard whose every row is dropped fails the job naming the reasons."""
    healthy = {**response_row(openrouter_turn(HEALTHY, "The user shares a story; I answer it.")), "id": "ok"}
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
        "gates: chat/00000: 12 rows, 1 trained, 11 dropped (91.7%): truncated 1 (8.3%), empty 1 (8.3%), "
        "content_filter 1 (8.3%), refusal 1 (8.3%), repetition 1 (8.3%), reasoning_leak 1 (8.3%), "
        "reasoning_missing 1 (8.3%), reasoning_in_content 1 (8.3%), tool_call_syntax 2 (16.7%), "
        "tool_call_as_text 1 (8.3%)"
    )
    write_jsonl_zst(tmp_path / "gated.jsonl.zst", rows[:-1])
    with pytest.raises(NothingTrained, match=r"none of its 11 response rows is trained \(truncated 1, empty 1,"):
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
        2, 12, 11, 2,
    )  # fmt: skip


def test_a_gate_above_its_share_of_a_shard_fails_the_job_naming_it(tmp_path, kimi_fast_dir):
    """A shard of 60 rows, 24 of them (40%) looping: the tokens job fails naming the partition, the shard,
    the gate, its rate and the setting; its counts were on the console first. With the share raised, or in
    a shard under min_rows_judged, it passes."""
    thought = "The user shares a story; I answer it."
    healthy = response_row(openrouter_turn(HEALTHY, thought))
    rows = [{**(ROWS["repetition"] if i % 5 < 2 else healthy), "id": f"p{i}"} for i in range(60)]
    shard = tmp_path / "chat" / "responses" / "00003.jsonl.zst"
    shard.parent.mkdir(parents=True)
    write_jsonl_zst(shard, rows)
    tokens, model = tmp_path / "chat" / "tokens", defaults("model")

    def run(rows_in, **gates):
        write_jsonl_zst(shard, rows_in)
        return run_tokens(
            shard, tokens / "00003.jsonl.zst", tokens / "00003.audit.json", kimi_fast_dir, model,
            token_settings(gates=gates),
        )  # fmt: skip

    with pytest.raises(GateRateExceeded) as failed:
        run(rows)
    assert str(failed.value) == (
        f"{shard} (partition chat, shard 00003): repetition dropped 24 of 60 rows (40.0%), above "
        "tokens.gates.max_shard_rates.repetition: 0.05. Look at the dropped rows (their ids and reasons are in "
        "this job's log): fix the responses (the provider, the template settings, the sampling) and rerun them, "
        "or raise the share under tokens.gates.max_shard_rates (or turn the gate off under tokens.gates)"
    )
    assert not (tokens / "00003.jsonl.zst").exists()
    report = run(rows, max_shard_rates={"repetition": 0.4})
    assert (report["gates"]["rows"], report["gates"]["counts"]["repetition"]) == (60, 24)
    assert len(read_jsonl(tokens / "00003.jsonl.zst")) == 36
    assert run(rows[:49])["gates"]["counts"]["repetition"] == 20  # 41%, under min_rows_judged (50)


def test_a_repetition_gate_that_could_judge_no_text_is_refused_before_any_job():
    from eagle3_datagen.workflow.config_checks import gate_problems

    config = {"tokens": defaults("tokens")}
    assert gate_problems(config) == []
    config["tokens"]["gates"]["repetition"].update(window=16, min_words=32)
    assert gate_problems(config) == [
        "tokens.gates.repetition: a window of 16 words is shorter than min_words 32, so no text would be judged; "
        "raise window or lower min_words (or set enabled: false)"
    ]
    config["tokens"]["gates"]["repetition"]["enabled"] = False
    assert gate_problems(config) == []
