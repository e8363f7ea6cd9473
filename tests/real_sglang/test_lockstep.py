"""Tensor parallelism for real: two SGLang ranks (torchrun, gloo on the CPU) resume in lockstep.

Byte equality is asserted only where it holds by construction: a resumed run against the
uninterrupted run of the same configuration (same ranks, same runner). Against one process the
states agree to a float32 tolerance, since a tp=2 all-reduce sums in another order.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from eagle3_datagen.backends.base import SingleProcess
from eagle3_datagen.backends.batching import capture_in_batches, plan_batches
from eagle3_datagen.backends.sglang.capture import SGLangCapture
from eagle3_datagen.config_schema import fill_defaults
from eagle3_datagen.formats.hidden_codec import Codec
from eagle3_datagen.formats.hidden_shard import HiddenShard, plan_parts
from tests.helpers import make_samples
from tests.helpers.sglang_cpu import CPU_CAPTURE_SETTINGS

SETTINGS = fill_defaults(
    {
        "dtype": "float32",
        "shard_bytes": 30_000,
        "max_batch_tokens": 64,
        "sglang": {**CPU_CAPTURE_SETTINGS, "device": "cpu"},
    },
    "hidden_states",
)


def test_two_ranks_resume_in_lockstep(tmp_path, tiny_model_dir, qwen_runner):
    samples = make_samples(23, seed=5)
    (tmp_path / "samples.json").write_text(json.dumps(samples))
    subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            str(Path(__file__).with_name("lockstep_ranks.py")),
            str(tiny_model_dir),
            str(tmp_path / "samples.json"),
            str(tmp_path),
            json.dumps(SETTINGS),
        ],
        check=True,
        timeout=900,
        # One core per rank: without it SGLang's CPU path allows one rank per NUMA node.
        env={**os.environ, "SGLANG_CPU_OMP_THREADS_BIND": "0|1"},
    )
    reports = [json.loads((tmp_path / f"report.{rank}.json").read_text()) for rank in (0, 1)]
    lengths = [len(s["input_ids"]) for s in samples]
    parts = plan_parts(lengths, Codec.from_settings(SETTINGS).bytes_per_token(3, 32), SETTINGS["shard_bytes"])
    assert len(parts) >= 3
    batches = [len(plan_batches([lengths[i] for i in part], 64, packed=True)) for part in parts]
    # Every rank made every forward pass; only rank 0 wrote; resuming redid only the missing parts.
    assert [r["full"] for r in reports] == [
        {"extends": sum(batches), "index": True},
        {"extends": sum(batches), "index": False},
    ]
    assert [r["resumed"]["extends"] for r in reports] == [sum(batches[2:])] * 2

    full, resumed = tmp_path / "full", tmp_path / "resumed"
    assert sorted(p.name for p in full.iterdir()) == sorted(p.name for p in resumed.iterdir())
    for part in full.glob("part-*"):
        assert (resumed / part.name).read_bytes() == part.read_bytes(), part.name
    index, resumed_index = (json.loads((d / "index.json").read_text()) for d in (full, resumed))
    assert resumed_index["throughput"]["tokens"] == sum(lengths[i] for part in parts[2:] for i in part)
    assert {**index, "throughput": None} == {**resumed_index, "throughput": None}  # all but the timing
    assert HiddenShard(resumed).ids == [s["id"] for s in samples]

    # Against SGLang tp=1 in this process: the same states, up to the order of the all-reduce.
    single = capture_in_batches(
        SGLangCapture(qwen_runner, "auto", "normed", ranks=SingleProcess()), [s["input_ids"] for s in samples], 64
    )
    stored = list(HiddenShard(resumed).iter_samples())
    for (aux, final), sample in zip(single, stored, strict=True):
        torch.testing.assert_close(sample["aux_hidden_states"], aux, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(sample["hidden_states"], final, atol=1e-5, rtol=1e-5)
