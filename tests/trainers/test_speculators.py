"""vLLM speculators 0.9.0 (its PyPI release, in .venv-speculators) on our speculators export.

(a) Its own reader (`ArrowDataset`, as `speculators train` builds it) loads every sample equal to
our shards bit for bit; (b) its own teacher (`verifier_lm_head(verifier_norm(last slot))`, loaded from
the verifier by its own code) predicts the stored next token wherever our LM head on the shard does;
(c) `speculators train` on the export directory lowers the loss. CPU only: `speculators_on_cpu.py`
sets the Trainer's device to "cpu" (it hard-codes device index 0 and a "cuda" autocast); flags
`--draft-attn-impl sdpa --loss-implementation eager --num-workers 0` pick its CPU paths.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

from eagle3_datagen.formats.hidden_shard import HiddenShard
from eagle3_datagen.stages.probe import LMHead

CPU_LAUNCHER = Path(__file__).with_name("speculators_on_cpu.py")


def stored(shards):
    return [s for d in shards for s in HiddenShard(d)]


def test_its_reader_loads_every_sample_bit_exact(captured):
    from speculators.train.data import ArrowDataset

    dataset = ArrowDataset(max_len=4096, datapath=captured["export"], on_missing="raise")
    ours = stored(captured["shards"])
    assert len(dataset) == len(ours) == 24
    for index, sample in enumerate(ours):
        row = dataset[index]
        assert torch.equal(row["input_ids"], sample["input_ids"].long())
        assert torch.equal(row["loss_mask"], sample["loss_mask"].long())
        assert torch.equal(row["hidden_states"], sample["aux_hidden_states"])  # the 3 auxiliary layers
        assert torch.equal(row["verifier_last_hidden_states"], sample["hidden_states"])  # layer N, pre-norm
        assert row["hidden_states"].dtype == torch.bfloat16


def test_its_fp8_backend_reads_an_fp8_export_as_our_reader_dequantizes_it(captured):
    """fp8 shards stay fp8 in the speculators export: the backend its command names (`--hidden-states-backend
    fp8`, hs_connectors 0.9.0's FP8Transfer, built from the registry as `speculators train` builds it) gives
    every sample's states equal to our reader's bf16 bit for bit, from files half the bytes of bf16."""
    import argparse

    from hs_connectors import HiddenStatesBackend
    from speculators.train.data import ArrowDataset

    export_dir = captured["fp8_export"]
    summary = json.loads((export_dir / "export.json").read_text())
    assert "--hidden-states-backend fp8" in summary["command"] and summary["dtype"] == "float8_e4m3"
    transfer = HiddenStatesBackend.registry["fp8"].from_train_args(
        argparse.Namespace(hidden_states_path=None), str(export_dir)
    )
    dataset = ArrowDataset(max_len=4096, datapath=export_dir, transfer=transfer, on_missing="raise")
    ours = list(HiddenShard(captured["fp8_shard"]))
    assert len(dataset) == len(ours) == 24
    for index, sample in enumerate(ours):
        row = dataset[index]
        assert torch.equal(row["hidden_states"], sample["aux_hidden_states"])
        assert torch.equal(row["verifier_last_hidden_states"], sample["hidden_states"])
    states = sum(p.stat().st_size for p in (export_dir / "hidden_states").iterdir())
    plain = sum(p.stat().st_size for p in (captured["export"] / "hidden_states").iterdir())
    assert states < 0.6 * plain


def dry_run_draft(export_dir: Path, verifier: Path, save: Path, vocab: Path):
    """An initialized EAGLE-3 draft saved by `speculators train --dry-run`, loaded back with the
    verifier's weights by speculators' own loader."""
    from speculators.models.eagle3.core import Eagle3DraftModel

    run = subprocess.run(
        [sys.executable, str(CPU_LAUNCHER), "train", *command_args(export_dir, verifier, save, vocab), "--dry-run"],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    d2t = torch.from_numpy(np.load(vocab / "d2t.npy"))
    t2d = torch.from_numpy(np.load(vocab / "t2d.npy"))
    return Eagle3DraftModel.from_pretrained(save, t2d=t2d, d2t=d2t, verifier=str(verifier)).float().eval(), d2t


def command_args(export_dir: Path, verifier: Path, save: Path, vocab: Path) -> list[str]:
    return [
        "--verifier-name-or-path", str(verifier),
        "--data-path", str(export_dir),
        "--target-layer-ids", "2", "4", "5",
        "--on-missing", "raise",
        "--draft-vocab-size", str(len(np.load(vocab / "d2t.npy"))),
        "--d2t-path", str(vocab / "d2t.npy"),
        "--t2d-path", str(vocab / "t2d.npy"),
        "--save-path", str(save),
        "--draft-attn-impl", "sdpa",
        "--loss-implementation", "eager",
        "--num-workers", "0",
        "--logger", "",
    ]  # fmt: skip


def test_its_teacher_agrees_with_the_stored_next_token(captured, verifier_dir, tmp_path):
    draft, d2t = dry_run_draft(captured["export"], verifier_dir, tmp_path / "draft", captured["vocab"])
    head = LMHead(verifier_dir)
    in_draft = torch.from_numpy(np.load(captured["vocab"] / "t2d.npy"))
    compared = agreed = trained = 0
    for sample in stored(captured["shards"]):
        ids, mask = sample["input_ids"].long(), sample["loss_mask"].bool()
        state, target = sample["hidden_states"][:-1], ids[1:]
        log_probs = head.log_probs(state, normed=False)  # `final: raw`: our head norms it
        with torch.no_grad():
            teacher = draft.verifier_lm_head(draft.verifier_norm(state.float())).argmax(-1)
        teacher = teacher + d2t[teacher]  # draft ids -> target ids
        where = mask[1:] & (log_probs.argmax(-1) == target) & in_draft[target]
        compared += int(where.sum())
        trained += int((mask[1:] & in_draft[target]).sum())
        agreed += int((teacher[where] == target[where]).sum())
        # Where they differ, the two tokens are a near tie for our head too (speculators loads the
        # verifier's head for the draft in its own precision).
        differ = where & (teacher != target)
        gap = log_probs[differ, target[differ]] - log_probs[differ, teacher[differ]]
        assert (gap < 0.05).all(), gap
    assert compared > 0.9 * trained  # greedy data: our head reproduces (nearly) every trained token
    assert agreed >= 0.99 * compared


def test_speculators_train_on_the_export_lowers_the_loss(captured, verifier_dir, tmp_path):
    args = command_args(captured["export"], verifier_dir, tmp_path / "run", captured["vocab"])
    args += ["--epochs", "5", "--lr", "1e-2", "--scheduler-type", "none", "--total-seq-len", "256", "--log-freq", "1"]
    env = {**os.environ, "COLUMNS": "300"}  # its rich log lines unwrapped
    run = subprocess.run([sys.executable, str(CPU_LAUNCHER), "train", *args], capture_output=True, text=True, env=env)
    assert run.returncode == 0, run.stderr[-4000:]
    losses = [float(v) for v in re.findall(r"train/loss=([0-9.e+-]+)", run.stdout + run.stderr)]
    assert len(losses) >= 10, (run.stdout + run.stderr)[-3000:]
    first, last = np.mean(losses[:3]), np.mean(losses[-3:])
    assert last < 0.8 * first, losses
    assert json.loads((captured["export"] / "export.json").read_text())["final_norm_applied"] is False
