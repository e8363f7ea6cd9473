"""The `sglang` hidden-state backend around a stand-in runner (SGLang itself needs GPUs).

What runs on a GPU only, SGLang's own model runner, is compared with `hf` by scripts/gpu_check.py.
"""

import itertools
import json
import shutil

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors import safe_open

from eagle3_datagen.capture_sglang import SGLangCapture, load_sglang_capture
from eagle3_datagen.gpu_check import agreement_by_layer, format_table, random_batch
from eagle3_datagen.hidden import (
    HFCapture,
    HiddenShard,
    SingleProcess,
    capture_in_batches,
    capture_shard,
    plan_batches,
)

from .sglang_standin import StandInRunner
from .test_hidden import make_samples

SETTINGS = {"dtype": "float32", "shard_bytes": 30_000, "max_batch_tokens": 64}


def standin_capture(model_dir, final="normed"):
    return SGLangCapture(StandInRunner(model_dir), "auto", final, ranks=SingleProcess())


@pytest.mark.parametrize("final", ["normed", "raw"])
def test_states_equal_the_hf_backend_layer_by_layer(tiny_model_dir, final):
    batch = [s["input_ids"] for s in make_samples(5, seed=3)]
    sglang_states = standin_capture(tiny_model_dir, final)(batch)
    hf_states = HFCapture(tiny_model_dir, "auto", final, {"dtype": "float32"})(batch)
    assert [aux.shape for aux, _ in sglang_states] == [(len(ids), 3 * 32) for ids in batch]
    for (aux, fin), (hf_aux, hf_fin) in zip(sglang_states, hf_states, strict=True):
        for layer in range(3):
            sl = slice(32 * layer, 32 * (layer + 1))
            torch.testing.assert_close(aux[:, sl], hf_aux[:, sl], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(fin, hf_fin, atol=1e-5, rtol=1e-5)


def test_raw_and_normed_finals_differ_by_the_final_norm(tiny_model_dir):
    batch = [make_samples(1, seed=4)[0]["input_ids"]]
    runner = StandInRunner(tiny_model_dir)
    [(_, raw)] = SGLangCapture(runner, "auto", "raw", ranks=SingleProcess())(batch)
    [(_, normed)] = standin_capture(tiny_model_dir, "normed")(batch)
    torch.testing.assert_close(runner.model.model.hf.norm(raw), normed, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(raw, normed)


def test_packed_batches_budget_tokens_not_rows_times_longest():
    lengths = [5, 1, 9, 3, 3, 7, 2]
    packed = plan_batches(lengths, max_batch_tokens=12, packed=True)
    assert sorted(i for b in packed for i in b) == list(range(7))
    assert all(sum(lengths[i] for i in b) <= 12 for b in packed)
    assert len(packed) < len(plan_batches(lengths, max_batch_tokens=12))


def test_other_capture_numbering_is_refused(tiny_model_dir):
    runner = StandInRunner(tiny_model_dir)
    runner.model.set_eagle3_layers_to_capture = lambda ids: setattr(runner.model.model, "layers_to_capture", ids)
    with pytest.raises(RuntimeError, match=r"captures layer inputs \[1, 3, 4\] for requested hidden_states indices"):
        SGLangCapture(runner, "auto", "normed", ranks=SingleProcess())


def test_states_cut_short_are_refused(tiny_model_dir):
    capture = standin_capture(tiny_model_dir)
    processor = capture.runner.model.logits_processor
    # What a prefix-cache hit does: the cached tokens' states never come back.
    processor.register_forward_pre_hook(
        lambda _m, args: (args[0], args[1][2:], args[2], args[3], [a[2:] for a in args[4]]), prepend=True
    )
    with pytest.raises(RuntimeError, match="prefix caching or chunked prefill must be off"):
        capture([[1, 2, 3, 4], [5, 6, 7]])


def test_sglang_backend_needs_torchrun(monkeypatch, tmp_path):
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(RuntimeError, match="torchrun --nproc-per-node"):
        load_sglang_capture(tmp_path, "auto", "normed", {}, False, 64)


def _rank_main(rank, world_size, model_dir, samples, out_dir, rendezvous, report):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world_size)
    try:
        runner = StandInRunner(model_dir)
        index = capture_shard(samples, out_dir, SGLangCapture(runner, "auto", "normed"), SETTINGS)
        report.with_name(f"{report.name}.{rank}").write_text(
            json.dumps({"extends": runner.extends, "index": index is not None})
        )
    finally:
        dist.destroy_process_group()


def run_ranks(world_size, model_dir, samples, out_dir, tmp_path, name):
    rendezvous = tmp_path / f"{name}.rdv"
    report = tmp_path / name
    mp.spawn(_rank_main, (world_size, model_dir, samples, out_dir, rendezvous, report), nprocs=world_size)
    return [json.loads(report.with_name(f"{name}.{r}").read_text()) for r in range(world_size)]


def assert_same_part_contents(ours, expected):
    """Equal layout, IDs, masks and metadata; states equal up to float rounding.

    Two one-thread ranks and one two-thread process may sum in a different order (seen on AMD
    EPYC), so states compare with a tolerance; bytes compare only between runs of one configuration.
    """
    with safe_open(ours, "pt") as a, safe_open(expected, "pt") as b:
        assert a.metadata() == b.metadata()
        keys = sorted(a.keys())
        assert keys == sorted(b.keys())
        for key in keys:
            got, want = a.get_tensor(key), b.get_tensor(key)
            if want.is_floating_point():
                torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
            else:
                assert torch.equal(got, want), key


def test_tensor_parallel_ranks_resume_in_lockstep(tmp_path, tiny_model_dir):
    samples = make_samples(23, seed=5)
    expected = capture_shard(samples, tmp_path / "single", standin_capture(tiny_model_dir), SETTINGS)
    assert len(expected["parts"]) >= 3

    reports = run_ranks(2, tiny_model_dir, samples, tmp_path / "tp", tmp_path, "full")
    assert [r["index"] for r in reports] == [True, False]  # rank 0 alone writes
    assert reports[0]["extends"] == reports[1]["extends"] > 0
    files = sorted(p.name for p in (tmp_path / "tp").iterdir())
    assert files == sorted([p["file"] for p in expected["parts"]] + ["index.json"])
    uninterrupted = {}
    for part in expected["parts"]:
        assert_same_part_contents(tmp_path / "tp" / part["file"], tmp_path / "single" / part["file"])
        uninterrupted[part["file"]] = (tmp_path / "tp" / part["file"]).read_bytes()

    # A job killed after two parts: its work directory holds them, the output does not exist.
    partial = tmp_path / ".tp.partial"
    partial.mkdir()
    for part in expected["parts"][:2]:
        shutil.copy(tmp_path / "tp" / part["file"], partial / part["file"])
    shutil.rmtree(tmp_path / "tp")
    resumed = run_ranks(2, tiny_model_dir, samples, tmp_path / "tp", tmp_path, "resumed")
    lengths = [len(s["input_ids"]) for s in samples]
    starts = list(itertools.accumulate(p["samples"] for p in expected["parts"]))
    remaining = sum(
        len(plan_batches(lengths[start - part["samples"] : start], SETTINGS["max_batch_tokens"], packed=True))
        for start, part in list(zip(starts, expected["parts"], strict=True))[2:]
    )
    assert [r["extends"] for r in resumed] == [remaining, remaining]
    # The same two ranks recompute the missing parts bit for bit.
    for name, data in uninterrupted.items():
        assert (tmp_path / "tp" / name).read_bytes() == data, name
    assert HiddenShard(tmp_path / "tp").ids == [s["id"] for s in samples]


def test_gpu_check_passes_equal_backends_and_names_a_wrong_layer(tiny_model_dir):
    batch = random_batch(512, samples=6, lo=3, hi=40)
    reference = HFCapture(tiny_model_dir, "auto", "normed", {"dtype": "float32"})
    expected = capture_in_batches(reference, batch, 64)
    ours = capture_in_batches(standin_capture(tiny_model_dir), batch, 64)
    rows = agreement_by_layer(ours, expected, [2, 4, 5], "normed")
    assert [r.layer for r in rows] == [
        "aux hidden_states[2]",
        "aux hidden_states[4]",
        "aux hidden_states[5]",
        "final (normed)",
    ]
    assert all(r.ok and r.min_cosine > 0.9999 for r in rows), format_table(rows)
    assert rows[0].tokens == sum(len(ids) for ids in batch)

    # An off-by-one the numbering check would not see: layer 4's states stored as layer 5's.
    wrong = standin_capture(tiny_model_dir)
    wrong.runner.model.model.layers_to_capture = [2, 4, 4]
    rows = agreement_by_layer(capture_in_batches(wrong, batch, 64), expected, [2, 4, 5], "normed")
    assert [r.ok for r in rows] == [True, True, False, True]
    assert "MISMATCH" in format_table(rows).splitlines()[3]


def test_a_rank_that_does_not_write_runs_the_same_forward_passes(tiny_model_dir):
    class Follower:
        writer = False

    runner = StandInRunner(tiny_model_dir)
    follower = SGLangCapture(runner, "auto", "normed", ranks=Follower())
    batch = random_batch(512, samples=5, lo=3, hi=40)
    assert capture_in_batches(follower, batch, 64) == [None] * 5
    assert runner.extends == len(plan_batches([len(ids) for ids in batch], 64, packed=True))
