"""The `dataset` backend on verbatim public records (tests/fixtures/realdata): each prompt answered by its
record's own assistant turns, in the rows the tokens stage reads.

The expected answers are read from the raw records here (their JSON keys), not from the project's parsers.
"""

import json
from pathlib import Path

import pytest

from eagle3_datagen.chat.template import resolve_special_tokens
from eagle3_datagen.config_schema import fill_defaults
from eagle3_datagen.formats.files import InputError, read_jsonl
from eagle3_datagen.stages.prompts import build_prompts
from eagle3_datagen.stages.responses.job import run_response_job
from eagle3_datagen.stages.responses.original import original_responses, split_reasoning
from eagle3_datagen.stages.tokens import build_samples
from tests.helpers import token_settings

REALDATA = Path(__file__).resolve().parents[1] / "fixtures" / "realdata"


@pytest.fixture(scope="module")
def kimi_think(kimi_fast):
    """Kimi-K2.5's think tokens as the job resolves them from the model's tokenizer (`think_tokens`)."""
    specials = resolve_special_tokens(kimi_fast)
    return specials.think_start, specials.think_end


def answered(tmp_path: Path, name: str, fmt: str, think, system_prompt: str | None = None):
    """The file's prompts (one shard) and the dataset backend's rows for them, both in source order."""
    prompts_path, out, stats = tmp_path / "prompts.jsonl.zst", tmp_path / "responses.jsonl.zst", tmp_path / "s.json"
    build_prompts(REALDATA / name, fmt, [prompts_path], tmp_path / "prompt-stats.json", system_prompt)
    dataset = {"source": str(REALDATA / name), "format": fmt, "system_prompt": system_prompt}
    original_responses(prompts_path, out, stats, dataset, think)
    rows = sorted(read_jsonl(out), key=lambda r: r["source"]["line"])
    return read_jsonl(prompts_path), rows, json.loads(stats.read_text())


def raw(name: str) -> list[dict]:
    return [json.loads(line) for line in (REALDATA / name).read_text().splitlines()]


def assistant(row: dict) -> list[dict]:
    return [m for m in row["messages"] if m["role"] == "assistant"]


def test_sharegpt_openai_and_alpaca_rows_carry_the_records_own_answers(tmp_path, kimi_think):
    assert kimi_think == ("<think>", "</think>")
    _, vicuna, stats = answered(tmp_path / "v", "sharegpt_vicuna.jsonl", "sharegpt", kimi_think)
    for row, record in zip(vicuna, raw("sharegpt_vicuna.jsonl"), strict=True):
        gpt = [t["value"] for t in record["conversations"] if t["from"] == "gpt"]
        assert [m["content"] for m in assistant(row)] == gpt
        humans = [t["value"] for t in record["conversations"] if t["from"] == "human"]
        assert [m["content"] for m in row["messages"] if m["role"] == "user"] == humans
        assert [m["turn"] for m in assistant(row)] == list(range(len(gpt)))
        assert {m["reasoning"] for m in assistant(row)} == {""} and "output_ids" not in assistant(row)[0]
        assert row["backend"] == "dataset" and row["status"] == "ok" and "ended" not in row
    turns = sum(len(assistant(r)) for r in vicuna)
    assert stats["assistant_turns"] == turns and stats["finish_reasons"] == {"stop": turns}
    assert stats["prompts"] == 2 and stats["status"] == {"ok": 2} and stats["source"].endswith("sharegpt_vicuna.jsonl")

    _, feedback, _ = answered(tmp_path / "f", "code_feedback.jsonl", "openai", kimi_think)
    (record,) = raw("code_feedback.jsonl")
    assert [m["content"] for m in assistant(feedback[0])] == [
        m["content"] for m in record["messages"] if m["role"] == "assistant"
    ]

    # the partition's system prompt goes first, as in the prompt; each instruction answered by its output
    system = "You are a helpful assistant."
    prompts, alpaca, _ = answered(tmp_path / "a", "alpaca_llamafactory.jsonl", "alpaca", kimi_think, system)
    records = raw("alpaca_llamafactory.jsonl")
    assert len(alpaca) == len(prompts) == 40
    for row in alpaca:
        record = records[row["source"]["line"] - 1]
        assert [m["role"] for m in row["messages"]] == ["system", "user", "assistant"]
        assert row["messages"][0]["content"] == system
        assert row["messages"][2]["content"] == record["output"]


def test_tool_call_turns_are_the_records_calls_with_their_recorded_results(tmp_path, kimi_think):
    prompts, rows, stats = answered(tmp_path, "glaive_toolcall_llamafactory.jsonl", "sharegpt", kimi_think)
    records = raw("glaive_toolcall_llamafactory.jsonl")
    by_id = {p["id"]: p for p in prompts}
    calls = 0
    for row in rows:
        record = records[row["source"]["line"] - 1]
        # the record's assistant side, in order: a call ({name, arguments} as JSON text) or an answer
        expected = [
            ("call", json.loads(t["value"])["name"], json.loads(t["value"])["arguments"])
            if t["from"] == "function_call"
            else ("answer", t["value"])
            for t in record["conversations"]
            if t["from"] in ("gpt", "function_call")
        ]
        got = [
            ("call", m["tool_calls"][0]["function"]["name"], json.loads(m["tool_calls"][0]["function"]["arguments"]))
            if m.get("tool_calls")
            else ("answer", m["content"])
            for m in assistant(row)
        ]
        assert got == expected, row["id"]
        for message in assistant(row):
            assert message["finish_reason"] == ("tool_calls" if message.get("tool_calls") else "stop")
        results = [t["value"] for t in record["conversations"] if t["from"] == "observation"]
        assert [m["content"] for m in row["messages"] if m["role"] == "tool"] == results
        # every turn but the records' answers is the prompt's own, in its order
        kept = [m for m in row["messages"] if m["role"] != "assistant" or m.get("tool_calls")]
        assert [(m["role"], m.get("content")) for m in kept] == [
            (m["role"], m.get("content")) for m in by_id[row["id"]]["messages"]
        ]
        assert row.get("tools") == by_id[row["id"]].get("tools")
        calls += sum(t["from"] == "function_call" for t in record["conversations"])
    assert stats["finish_reasons"]["tool_calls"] == calls == 196  # in the 267 distinct records


def test_the_tokens_stage_trains_the_records_answers_as_kimi_emits_them(tmp_path, kimi_fast_dir, kimi_fast):
    """The job as the workflow runs it (its think tokens from the model directory), then the tokens stage
    with Kimi-K2.5's real tokenizer and template: the last answer is trained as `</think>{answer}<|im_end|>`
    (no reasoning in these records), the earlier answers in the loss where the prompt renders them."""
    prompts_path, out = tmp_path / "p.jsonl.zst", tmp_path / "r.jsonl.zst"
    build_prompts(REALDATA / "sharegpt_vicuna.jsonl", "sharegpt", [prompts_path], tmp_path / "ps.json")
    model = fill_defaults({"path": str(kimi_fast_dir)}, "model")
    dataset = {"source": str(REALDATA / "sharegpt_vicuna.jsonl"), "format": "sharegpt", "system_prompt": None}
    run_response_job(
        [(prompts_path, out, tmp_path / "rs.json")], {"backend": "dataset", "dataset": dataset, "model": model}
    )
    rows = sorted(read_jsonl(out), key=lambda r: r["source"]["line"])
    samples, report = build_samples(rows, kimi_fast_dir, model, token_settings(max_length=32768))
    assert [s["id"] for s in samples] == [r["id"] for r in rows] and report["counts"]["ids_from_text"] == 2
    for sample, row in zip(samples, rows, strict=True):
        trained = [t for t, bit in zip(sample["input_ids"], sample["loss_mask"], strict=True) if bit]
        text = kimi_fast.decode(trained)
        last = assistant(row)[-1]["content"]
        assert text.endswith(f"</think>{last}<|im_end|>")
        for earlier in assistant(row)[:-1]:
            assert earlier["content"] in text


def test_inline_reasoning_is_split_off_as_a_reasoning_parser_splits_it():
    assert split_reasoning("<think>\nweigh it\n</think>\n\nThe answer.", "<think>", "</think>") == (
        "weigh it",
        "The answer.",
    )
    # Kimi writes no <think> of its own: its generation prompt opened the block
    assert split_reasoning("weigh it</think>The answer.", "<think>", "</think>") == ("weigh it", "The answer.")
    assert split_reasoning("The answer.", "<think>", "</think>") == ("", "The answer.")
    # a model without think tokens keeps the text as written
    assert split_reasoning("<think>x</think>y", None, None) == ("", "<think>x</think>y")


def test_a_source_changed_since_the_prompts_names_the_record_and_the_fix(tmp_path, kimi_think):
    source = tmp_path / "chat.jsonl"
    records = raw("sharegpt_vicuna.jsonl")
    source.write_text("".join(json.dumps(r) + "\n" for r in records))
    prompts_path = tmp_path / "p.jsonl.zst"
    build_prompts(source, "sharegpt", [prompts_path], tmp_path / "ps.json")
    records[1]["conversations"][0]["value"] += " (edited)"
    source.write_text("".join(json.dumps(r) + "\n" for r in records))
    dataset = {"source": str(source), "format": "sharegpt", "system_prompt": None}
    out = tmp_path / "r.jsonl.zst"
    with pytest.raises(InputError, match=rf"{source}:2: the record is no longer the one prompt .* rerun the partition"):
        original_responses(prompts_path, out, tmp_path / "rs.json", dataset, kimi_think)
    assert not out.exists()
