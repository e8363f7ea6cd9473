"""The `hf` backend under the journaled driver: fixed lockstep groups, resume, budgets, one load per job.

The model is a real forward pass: a tiny random Qwen3 with Qwen3's real tokenizer whose LM head
is zero but for random rows for eight words and `<|im_end|>`, so that each greedy step emits one
of them, depending on the hidden state: some turns stop after a few words, others run into
`max_new_tokens`, and multi-turn prompts whose first answer stopped go on to their next user turn.
"""

import asyncio
import contextlib

import pytest
import torch

from eagle3_datagen.backends.hf import generate as hf_generate
from eagle3_datagen.backends.hf.generate import HFBackend
from eagle3_datagen.formats.files import read_jsonl, write_jsonl_zst
from eagle3_datagen.formats.journal import journal_path
from eagle3_datagen.stages.responses.job import JobError, run_response_job
from eagle3_datagen.stages.responses.journaled import Budgets, IncompleteRun, run_journaled_responses
from tests.helpers import defaults, tiny_qwen3

THINKING_OFF = defaults("model", chat_template_kwargs={"enable_thinking": False})
SAMPLING = defaults("inference.sampling", max_new_tokens=6, temperature=0.0)
WORDS = ["Yes", " no", " maybe", " the", " cat", " dog", " runs", " fast"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, qwen_tokenizer):
    torch.manual_seed(2)
    model = tiny_qwen3(len(qwen_tokenizer), num_layers=2, tie_word_embeddings=False)
    words = [qwen_tokenizer(w, add_special_tokens=False)["input_ids"][0] for w in WORDS]
    with torch.no_grad():
        model.lm_head.weight.zero_()
        for token in [*words, qwen_tokenizer.convert_tokens_to_ids("<|im_end|>")]:
            model.lm_head.weight[token] = torch.randn(model.config.hidden_size)
    path = tmp_path_factory.mktemp("hf") / "Tiny-Qwen3"
    model.save_pretrained(path)
    qwen_tokenizer.save_pretrained(path)
    return path


def prompts_file(path, n=8):
    rows = []
    for i in range(n):
        messages = [{"role": "user", "content": f"q{i} " + "tell me more " * (i % 3)}]
        if i % 2:  # a second user turn (a prompt keeps no recorded answers without calls)
            messages.append({"role": "user", "content": f"and then {i}?"})
        rows.append({"id": f"p{i}", "source": "test", "messages": messages})
    write_jsonl_zst(path, rows)
    return path


@contextlib.contextmanager
def spied(backend):
    """`backend` recording each batch as the prompt ids (from their first user turn) it answers."""
    batches, answer = [], backend.answer

    def recording(requests):
        batches.append(sorted(messages[0]["content"].split()[0].replace("q", "p") for messages, _ in requests))
        return answer(requests)

    backend.answer = recording
    try:
        yield batches
    finally:
        del backend.answer  # the class's own again


@pytest.fixture(scope="module")
def backend(model_dir):
    """The backend the interrupted runs share (a model load of its own, as a rerun's process has)."""
    return HFBackend(model_dir, SAMPLING, defaults("inference.hf", batch_size=3), THINKING_OFF)


def run(backend, prompts, out, budgets=None):
    return run_journaled_responses(prompts, out, out.with_suffix(".stats"), backend, budgets or Budgets())


@pytest.fixture(scope="module")
def uninterrupted(model_dir, tmp_path_factory):
    """One run without a stop: its output bytes, its rows and the batches it ran."""
    work = tmp_path_factory.mktemp("whole")
    whole = HFBackend(model_dir, SAMPLING, defaults("inference.hf", batch_size=3), THINKING_OFF)
    with spied(whole) as batches:
        stats = run(whole, prompts_file(work / "prompts.jsonl.zst"), work / "out.jsonl.zst")
    return (work / "out.jsonl.zst").read_bytes(), read_jsonl(work / "out.jsonl.zst"), batches, stats


def test_groups_are_fixed_and_each_turn_batches_a_groups_live_conversations(uninterrupted):
    _, rows, batches, stats = uninterrupted
    assert [r["id"] for r in rows] == [f"p{i}" for i in range(8)]
    # groups of 3 by first-turn length; a group's next batch holds those whose answer stopped and
    # who have another user turn (p5's first answer ran into max_new_tokens: it ends there)
    assert batches == [["p0", "p3", "p6"], ["p3"], ["p1", "p4", "p7"], ["p1", "p7"], ["p2", "p5"]]
    assert stats["status"] == {"ok": 3, "truncated": 5} and stats["finish_reasons"] == {"stop": 6, "length": 5}
    assistant_turns = {r["id"]: [m["turn"] for m in r["messages"] if m["role"] == "assistant"] for r in rows}
    assert assistant_turns == {"p1": [0, 1], "p3": [0, 1], "p7": [0, 1]} | {
        p: [0] for p in ("p0", "p2", "p4", "p5", "p6")
    }
    assert stats["failed"] == {} and stats["throughput"]["prompts"] == 8


def test_a_budget_stop_then_a_rerun_generates_only_what_is_missing_byte_for_byte(backend, tmp_path, uninterrupted):
    whole_bytes, _, whole_batches, _ = uninterrupted
    prompts, out = prompts_file(tmp_path / "prompts.jsonl.zst"), tmp_path / "out.jsonl.zst"
    stopped = pytest.raises(IncompleteRun, match=r"3 of 8 prompts finished, 5 left \(inference.token_budget=1 reached")
    with spied(backend) as batches, stopped:
        run(backend, prompts, out, Budgets(tokens=1))  # checked before each group: the first one runs
    assert batches == whole_batches[:2] and not out.exists()
    with spied(backend) as batches:
        stats = run(backend, prompts, out, Budgets(tokens=10_000))
    assert batches == whole_batches[2:]  # the other groups, batched as the uninterrupted run batched them
    assert stats["throughput"]["prompts"] == 5 and stats["prompts"] == 8
    assert out.read_bytes() == whole_bytes
    assert len(journal_path(out).read_text().splitlines()) == 1 + 8  # kept: the shard's answers


def test_a_crash_then_a_rerun_keeps_what_was_journaled_and_matches_byte_for_byte(backend, tmp_path, uninterrupted):
    """A crash in the middle of the second group's batches (an exception from the model), then the
    journal cut after the first row of the first group, as a kill between its appends leaves it."""
    whole_bytes, whole_rows, whole_batches, _ = uninterrupted
    prompts, out = prompts_file(tmp_path / "prompts.jsonl.zst"), tmp_path / "out.jsonl.zst"
    with spied(backend) as batches:
        answer = backend.answer

        def crashing(requests):
            if len(batches) == 3:
                raise MemoryError("killed")
            return answer(requests)

        backend.answer = crashing
        with pytest.raises(MemoryError):
            run(backend, prompts, out)
    journal = journal_path(out)
    header, *journaled = journal.read_text().splitlines()
    assert len(journaled) == 3  # the first group; nothing of the second
    journal.write_text("\n".join([header, journaled[0], journaled[1][:20]]))  # torn mid-line
    with spied(backend) as batches:
        stats = run(backend, prompts, out)
    # the torn group reran whole (its batches as before), the crashed one and the last one too
    assert batches == whole_batches
    assert out.read_bytes() == whole_bytes
    assert stats["throughput"]["prompts"] == 7  # the journaled row of the torn group is kept, not appended again
    assert read_jsonl(out) == whole_rows


def test_answers_do_not_depend_on_the_order_conversations_ask_in(backend):
    asks = [[{"role": "user", "content": f"q{i} " + "more " * i}] for i in range(4)]

    async def answers(order):
        group = backend.group(len(asks))
        turns = await asyncio.gather(*(group.generate(asks[i], None) for i in order))
        return dict(zip(order, turns, strict=True))

    forward, backward = asyncio.run(answers([0, 1, 2, 3])), asyncio.run(answers([3, 1, 0, 2]))
    assert forward == backward
    alone = asyncio.run(backend.generate(asks[2], None))  # a batch of its own: no padding
    assert alone.content == forward[2].content and alone.output_ids == forward[2].output_ids


def test_the_journal_resumes_under_another_batch_size_outlives_the_output_and_a_raised_limit_keeps_what_ended(
    backend, tmp_path, monkeypatch
):
    """The journal's answers are kept across a batch size (float bits, not meaning), across the output's
    deletion (Snakemake deletes a job's outputs before it runs it again) and across a raised
    max_new_tokens, for the answers that ended within the old one: only the truncated are asked again.
    Other sampling sets the journal aside."""
    prompts, out = prompts_file(tmp_path / "prompts.jsonl.zst", n=4), tmp_path / "out.jsonl.zst"
    with pytest.raises(IncompleteRun):
        run(backend, prompts, out, Budgets(tokens=1))
    with monkeypatch.context() as patched:
        patched.setattr(backend, "batch_size", 4)
        stats = run(backend, prompts, out)
    assert stats["throughput"]["prompts"] == 1  # resumed: batch_size changes float bits, not meaning
    before = {row["id"]: row for row in read_jsonl(out)}
    out.unlink()
    assert run(backend, prompts, out)["throughput"]["prompts"] == 0
    truncated = {i for i, row in before.items() if row["status"] == "truncated"}
    assert 0 < len(truncated) < 4
    out.unlink()
    monkeypatch.setattr(backend, "sampling", {**SAMPLING, "max_new_tokens": 12})
    stats = run(backend, prompts, out)
    assert stats["throughput"]["prompts"] == len(truncated)  # the others are the journal's
    after = {row["id"]: row for row in read_jsonl(out)}
    assert all(after[i] == before[i] for i in before if i not in truncated)
    for i in truncated:  # the greedy answer again, further: the cut one is its beginning
        old = next(m for m in before[i]["messages"] if m.get("finish_reason") == "length")
        new = next(m for m in after[i]["messages"] if m.get("turn") == old["turn"] and m["role"] == "assistant")
        assert new["output_ids"][:6] == old["output_ids"] and len(new["output_ids"]) > 6
    out.unlink()
    monkeypatch.setattr(backend, "sampling", {**SAMPLING, "max_new_tokens": 12, "top_k": 3})
    stats = run(backend, prompts, out)
    assert stats["throughput"]["prompts"] == 4
    assert journal_path(out).with_name(journal_path(out).name + ".stale").exists()


def test_a_job_loads_the_model_once_and_its_token_budget_stops_it(model_dir, tmp_path, monkeypatch):
    loads = []
    load = hf_generate.load_causal_lm
    monkeypatch.setattr(hf_generate, "load_causal_lm", lambda *a, **k: loads.append(a) or load(*a, **k))
    shards = [
        (prompts_file(tmp_path / f"{s}.jsonl.zst", n=4), tmp_path / f"{s}.out.jsonl.zst", tmp_path / f"{s}.json")
        for s in ("a", "b")
    ]
    settings = {
        "backend": "hf",
        "max_failed_rate": 0.0,
        "model": {"path": str(model_dir), **THINKING_OFF},
        "sampling": SAMPLING,
        "hf": defaults("inference.hf", batch_size=2),
        "token_budget": 1,
    }
    with pytest.raises(JobError, match=r"2 of 4 prompts finished, 2 left \(inference.token_budget=1 reached"):
        run_response_job(shards, settings)
    assert len(loads) == 1
    run_response_job(shards, {**settings, "token_budget": None})
    assert len(loads) == 2  # one per job, both shards
    assert [r["id"] for r in read_jsonl(shards[1][1])] == [f"p{i}" for i in range(4)]
