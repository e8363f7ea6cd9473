"""A draft trained on an export by SpecForge 0.2.0's release, loaded by its own model class, and what
SpecForge itself computes of it: its training-time (TTT) forward and its offline acceptance estimate.

Runs in SpecForge's venv (`make specforge-env`: it pins transformers 5.8.1). With `evaluate.device: cuda`
`specforge train` runs as released on one GPU (sdpa attention for a draft with heads under 16 wide,
which flex attention does not take). On the CPU it runs as released but for documented
substitutions, the same as tests/trainers/test_specforge.py's:
- `specforge train` overrides it supports as they are (`CPU_OVERRIDES`): sdpa attention (its default
  flex_attention has no CPU backward), no FSDP sharding (DDP over gloo), no dataloader workers;
- `TORCHDYNAMO_DISABLE=1`: its `torch.compile`d helpers run eagerly (compiled, they recompile for every
  sequence length);
- its Triton loss kernel, which has no CPU backend, replaced by the reference implementation its own
  module keeps (`specforge_on_cpu`; `specforge_cpu/sitecustomize.py` for its processes).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import TextIO

import torch
import yaml

from eagle3_datagen.formats.draft_vocab import VOCAB_MAPPING

SPECFORGE_CPU = Path(__file__).parent / "specforge_cpu"
CPU_OVERRIDES = ["training.attention_backend=sdpa", "training.fsdp_sharding=NO_SHARD", "data.dataloader_num_workers=0"]
# SpecForge's default attention on a GPU, flex attention, is lowered to Triton kernels that need a head
# dimension of at least 16 (torch inductor: "NYI: embedding dimension ... must be at least 16").
FLEX_MIN_HEAD_DIM = 16


def gpu_overrides(export_dir: Path) -> list[str]:
    """`specforge train` overrides on a GPU: none, but sdpa attention for a draft whose heads are narrower
    than flex attention takes (the tiny targets' drafts)."""
    draft = json.loads((export_dir / "draft_config.json").read_text())
    head_dim = draft.get("head_dim") or draft["hidden_size"] // draft["num_attention_heads"]
    return ["training.attention_backend=sdpa"] if head_dim < FLEX_MIN_HEAD_DIM else []


def cpu_env(environ: dict) -> dict:
    """`environ` for SpecForge's CPU training processes: its helpers eager, its loss through the reference
    (`specforge_cpu/sitecustomize.py`, ahead of whatever PYTHONPATH already holds)."""
    path = os.pathsep.join(p for p in (str(SPECFORGE_CPU), environ.get("PYTHONPATH")) if p)
    return {**environ, "TORCHDYNAMO_DISABLE": "1", "PYTHONPATH": path}


def specforge_on_cpu() -> None:
    """In this process, SpecForge as its CPU training processes run it: its Triton loss kernel (no CPU
    backend) through the reference implementation its own module keeps, its `torch.compile`d helpers eager."""
    from specforge.core import loss

    torch._dynamo.config.disable = True
    reference = getattr(loss._compute_loss, "_torchdynamo_orig_callable", loss._compute_loss)
    loss.LogSoftmaxLoss.apply = staticmethod(reference)


# The files of an export's `specforge.yaml` that live outside it or beside it (its `model` section).
MODEL_PATHS = ("target_model_path", "draft_model_config", "vocab_mapping_path")


def train_config(export_dir: Path, vocab_dir: Path | None = None) -> dict:
    """The export's `specforge.yaml` with its paths where they are now. The export job writes them absolute,
    inside the work directory it ran in: in a copied or moved work directory those are re-rooted under it,
    so that a draft trains on the samples beside its config (a path outside, such as a production
    checkpoint's, stays as written). With `vocab_dir`, its draft vocabulary instead of the one the export names."""
    export_dir = export_dir.resolve()
    config = yaml.safe_load((export_dir / "specforge.yaml").read_text())
    written = Path(config["data"]["hidden_states_path"])  # the export's own directory when it was written
    common = 0  # the trailing path parts that the export's old and new directories share
    while common < min(len(written.parts), len(export_dir.parts)) - 1 and (
        written.parts[-1 - common] == export_dir.parts[-1 - common]
    ):
        common += 1
    old_root, new_root = written.parents[common - 1], export_dir.parents[common - 1]

    def now(path: str) -> str:
        return str(new_root / Path(path).relative_to(old_root)) if Path(path).is_relative_to(old_root) else path

    config["model"] = {key: now(value) if key in MODEL_PATHS else value for key, value in config["model"].items()}
    if vocab_dir is not None:
        config["model"]["vocab_mapping_path"] = str(vocab_dir.resolve() / VOCAB_MAPPING)
    config["data"]["hidden_states_path"] = str(export_dir)
    return config


def train_draft(
    export_dir: Path, out_dir: Path, settings: dict, log: TextIO, data: Path | None = None, vocab: Path | None = None
) -> Path:
    """`specforge train` on the export's own `specforge.yaml` (its samples, or those under `data`; its draft
    vocabulary, or the one under `vocab`) for `settings` (the `evaluate` section: steps, seed, batch_size,
    learning_rate, ttt_length, device) at a fixed seed, its output to `log`; returns the trained draft's
    checkpoint directory (SpecForge's latest under `out_dir/run`, its output_dir)."""
    # SpecForge runs in out_dir: every path it is given is absolute
    export_dir, out_dir = export_dir.resolve(), out_dir.resolve()
    data = data.resolve() if data is not None else None
    steps = settings["steps"]
    config = train_config(export_dir, vocab)
    train = [str(Path(sys.executable).parent / "specforge"), "train", "--config", str(export_dir / "specforge.yaml")]
    train += [f"model.{key}={path}" for key, path in config["model"].items() if key in MODEL_PATHS]
    train.append(f"data.hidden_states_path={data or config['data']['hidden_states_path']}")
    on_cpu = settings["device"] == "cpu"
    train += CPU_OVERRIDES if on_cpu else gpu_overrides(export_dir)
    train += [f"training.max_steps={steps}", f"training.num_epochs={steps}"]
    train += [f"training.batch_size={settings['batch_size']}"]
    train += [f"training.learning_rate={settings['learning_rate']}", "training.warmup_ratio=0"]
    train += ["training.lr_scheduler=constant", f"training.ttt_length={settings['ttt_length']}"]
    train += [f"training.seed={settings['seed']}", f"training.save_interval={steps}", "training.log_interval=1"]
    train += [f"output_dir={out_dir / 'run'}", f"data.cache_dir={out_dir / 'cache'}"]
    out_dir.mkdir(parents=True, exist_ok=True)
    log.write(" ".join(train) + "\n")
    log.flush()
    env = cpu_env(dict(os.environ)) if on_cpu else dict(os.environ)
    subprocess.run(train, check=True, env=env, cwd=out_dir, stdout=log, stderr=subprocess.STDOUT)
    # SpecForge's `{run_id}-latest` link names its last checkpoint directory
    (latest,) = (out_dir / "run").glob("*-latest")
    return latest.resolve()


def load_draft(run_dir: Path, export_dir: Path, vocab_dir: Path | None = None):
    """The trained draft as SpecForge's own export builds it (`materialize_draft`: `AutoDraftModel.from_config`,
    `LlamaForCausalLMEagle3`, the checkpoint's weights and the vocabulary mapping), the frozen embedding
    from the target (`load_embedding`), in float32 (bf16 weights widen exactly). Not `from_pretrained`:
    transformers builds the model on the meta device, which leaves SpecForge's rotary caches (non-persistent
    buffers) uninitialised. `vocab_dir`: the draft vocabulary it was trained with, if not the export's."""
    from specforge.export.checkpoint_io import materialize_draft, resolve_training_state

    model = train_config(export_dir, vocab_dir)["model"]
    draft = materialize_draft(
        resolve_training_state(str(run_dir)),
        model["draft_model_config"],
        vocab_mapping_path=model.get("vocab_mapping_path"),
    )
    draft.load_embedding(model["target_model_path"], embedding_key=model["embedding_key"])
    return draft.float().eval()


@torch.no_grad()
def training_forward(
    draft, aux: torch.Tensor, ids: list[int], target_logits: torch.Tensor, loss_mask: list[int], length: int
) -> dict:
    """SpecForge's own training-time forward (`OnlineEagle3Model`, TTT unrolled `length` steps) on one
    sequence, inputs prepared as its offline strategy does (`TargetHead.preprocess`: tokens and target
    shifted left by one, the loss mask as the export stores it). Returns per TTT step k the draft's
    predicted target tokens at every position (`predictions` [length, L]: row k, column t predicts
    token t + 2 + k) and SpecForge's per-step correct and denominator counts over the loss mask."""
    from specforge.algorithms.eagle3.model import OnlineEagle3Model
    from specforge.utils import padding

    predictions = []
    compute_logits = draft.compute_logits

    def recorded(hidden):
        logits = compute_logits(hidden)
        index = logits.argmax(-1)
        predictions.append((index + draft.d2t[index])[0])
        return logits

    draft.compute_logits = recorded
    try:
        input_ids = padding(torch.tensor([ids]), left=False)
        target = padding(target_logits[None].float(), left=False)
        outputs = OnlineEagle3Model(draft, length=length, attention_backend="sdpa")(
            input_ids=input_ids,
            attention_mask=torch.ones(1, len(ids), dtype=torch.bool),
            target=target,
            loss_mask=torch.tensor([loss_mask])[..., None],
            hidden_states=aux[None].float(),
        )
    finally:
        del draft.compute_logits
    corrects, denoms = outputs[3], outputs[4]
    return {
        "predictions": torch.stack(predictions),
        "corrects": [float(c) for c in corrects],
        "denoms": [float(d) for d in denoms],
    }


def trainer_estimate(corrects: list[float], denoms: list[float], steps: int) -> dict:
    """SpecForge's offline estimate from counts summed over the held-out set, as its `Evaluator` sums
    them: per-position accuracies and `simulated_acc_len` (no bonus token: + 1 to compare it with an
    acceptance length), over all TTT positions and over the decoding's `steps` positions."""
    from specforge.eval.evaluator import Evaluator

    accuracies = [c / max(d, 1.0) for c, d in zip(corrects, denoms, strict=True)]
    return {
        "per_position_acc": accuracies,
        "simulated_acc_len": Evaluator._simulated_acc_len(accuracies),
        "simulated_acc_len_plus_1": Evaluator._simulated_acc_len(accuracies) + 1,
        "simulated_acc_len_plus_1_at_steps": Evaluator._simulated_acc_len(accuracies[:steps]) + 1,
    }
