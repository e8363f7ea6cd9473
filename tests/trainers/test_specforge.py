"""SpecForge 0.2.0 itself, on the CPU, on our SpecForge exports: run under .venv-specforge
(`make specforge-env`; `.venv-specforge/bin/python -m pytest -q -o addopts=-ra tests/trainers/test_specforge.py`).

The exports are built as the workflow builds them, by the project's own venv (`.venv`, the workflow's
environment; build_specforge_export.py): the demo's tied-embedding Qwen3 with Qwen3's tokenizer and the
tiny Kimi's DeepseekV3 with Kimi's tokenizer (the workflow's model sizes, randomly initialised, written
by the targets' own writers with their `model.safetensors.index.json`), greedy continuations of random
prompts, the vocabulary stage, the hidden stage with `final: raw` and with `final: normed`, and
scripts/export.py. Everything after that is SpecForge's own code, reading the export directory:
`OfflineManifestReader` and `LocalFeatureStore` (its offline reader and the store its loader reads
through), its EAGLE-3 normaliser, `TargetHead`, its draft-config and draft-model builders, and its
`specforge train` CLI with the export's own `specforge.yaml`.

What the CPU needs, and nothing of how SpecForge reads data:
- config overrides on the `specforge train` command line, which SpecForge supports as they are:
  `training.attention_backend=sdpa` (with its default flex_attention: "FlexAttention does not
  support backward on CPU"), `training.fsdp_sharding=NO_SHARD` (its default SHARD_GRAD_OP: "FSDP
  needs a non-CPU accelerator device"; with NO_SHARD SpecForge wraps the draft in DDP, gloo on the
  CPU), `data.dataloader_num_workers=0` (two cores); its device placement already falls back to the CPU.
- `TORCHDYNAMO_DISABLE=1`: SpecForge wraps its RMSNorm, rotary and target-softmax functions in
  `torch.compile`, which works on the CPU but recompiles for every new sequence length (three
  minutes for the first step on this machine); disabled, the same functions run eagerly.
- stages/evaluate/specforge_cpu/sitecustomize.py (the package's): its Triton loss kernel has no CPU
  backend, so `LogSoftmaxLoss` runs the reference implementation the same module keeps (`_compute_loss`).
"""

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from safetensors import safe_open

try:
    from specforge.runtime.data_plane.offline_reader import OfflineManifestReader
except ImportError as error:  # collected by the main venv's pytest: say how to run it
    raise ImportError("tests/trainers/test_specforge.py runs under .venv-specforge: `make specforge-env`") from error

from specforge.algorithms.eagle3.data import normalize_offline_sample
from specforge.algorithms.model_providers import build_eagle3_draft
from specforge.application import resolve_run
from specforge.config import load_config
from specforge.modeling.target.target_head import TargetHead
from specforge.runtime.data_plane.feature_store import LocalFeatureStore
from specforge.training.model_loading import _generate_draft_config, resolve_draft_config

from eagle3_datagen.formats.hidden_shard import HiddenShard
from eagle3_datagen.stages.evaluate.draft import CPU_OVERRIDES, cpu_env
from eagle3_datagen.stages.probe import LMHead

pytestmark = pytest.mark.trainers


@pytest.fixture(scope="module", params=["demo", "kimi"])
def built(request, specforge_build) -> Path:
    return specforge_build(request.param)


def ours(built: Path, final: str) -> list[dict]:
    return list(HiddenShard(built / "hidden" / final))


def documented_norm(hidden: torch.Tensor, model_dir: Path) -> torch.Tensor:
    """docs/formats.md's transform, computed here from the checkpoint's own tensor and config."""
    config = json.loads((model_dir / "config.json").read_text())
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        weight = f.get_tensor("model.norm.weight").float()
    h = hidden.float()
    return (weight * h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + config["rms_norm_eps"])).to(hidden.dtype)


def specforge_rows(export_dir: Path) -> list[tuple[dict, dict]]:
    """Every sample as SpecForge's trainer gets it: the reader's refs, read through its feature store."""
    store = LocalFeatureStore()
    rows = []
    for ref in OfflineManifestReader(str(export_dir)).read():
        tensors, handle = store.get(ref)
        rows.append((ref, {name: t.clone() for name, t in tensors.items()}))
        store.release(handle)
    return rows


def test_reader_reads_every_sample_as_stored_with_the_final_norm_applied(built):
    model_dir = built / "model"
    raw, normed = ours(built, "raw"), ours(built, "normed")
    for final, samples in (("raw", raw), ("normed", normed)):
        export_dir = built / "export" / final
        ids = [json.loads(line)["id"] for line in (export_dir / "ids.jsonl").read_text().splitlines()]
        assert json.loads((export_dir / "export.json").read_text())["final_norm_applied"] is (final == "raw")
        rows = specforge_rows(export_dir)
        assert len(rows) == len(samples) == len(ids) == 16
        for index, ((ref, data), sample) in enumerate(zip(rows, samples, strict=True)):
            assert ref.metadata["file_index"] == index and ids[index] == sample["id"]  # export order
            assert torch.equal(data["input_ids"], sample["input_ids"].long())
            assert torch.equal(data["loss_mask"], sample["loss_mask"].long())
            assert torch.equal(data["aux_hidden_state"][0], sample["aux_hidden_states"])
            stored = sample["hidden_states"]
            expected = documented_norm(stored, model_dir) if final == "raw" else stored
            assert data["hidden_state"].dtype == torch.bfloat16
            assert torch.equal(data["hidden_state"][0], expected)
            # SpecForge's EAGLE-3 normaliser: the final state is its target, the auxiliary layers its input.
            batch = normalize_offline_sample(data, max_len=2048)
            assert torch.equal(batch["target"][0], expected) and torch.equal(
                batch["hidden_state"][0], data["aux_hidden_state"][0]
            )
    # One capture serves both conventions: the norm applied to layer N equals the model's own normed
    # output up to bf16 rounding of the stored states.
    for raw_sample, normed_sample in zip(raw, normed, strict=True):
        exported = documented_norm(raw_sample["hidden_states"], model_dir).float()
        assert torch.allclose(exported, normed_sample["hidden_states"].float(), rtol=0.02, atol=0.02)


def test_its_reader_reads_gzipped_rows_as_the_plain_ones(built):
    """export.specforge.compress: gzip writes `.ckpt.gz` rows, which SpecForge's own reader lists and its
    feature store decompresses (`load_feature_file`): the same tensors, in the same order, as the plain rows."""
    gzipped, plain = specforge_rows(built / "export" / "raw-gzip"), specforge_rows(built / "export" / "raw")
    assert len(gzipped) == len(plain) == 16
    assert all(ref.feature_store_uri.endswith(".ckpt.gz") for ref, _ in gzipped)
    for (ref, data), (plain_ref, plain_data) in zip(gzipped, plain, strict=True):
        assert ref.metadata["file_index"] == plain_ref.metadata["file_index"]
        assert data.keys() == plain_data.keys()
        assert all(torch.equal(data[name], plain_data[name]) for name in data)


def test_target_head_predicts_the_stored_tokens_where_our_probe_does(built):
    config = yaml.safe_load((built / "export" / "raw" / "specforge.yaml").read_text())
    head = TargetHead.from_pretrained(config["model"]["target_model_path"], lm_head_key=config["model"]["lm_head_key"])
    ours_head = LMHead(built / "model")
    agreed = 0
    for (_, data), sample in zip(specforge_rows(built / "export" / "raw"), ours(built, "raw"), strict=True):
        ids = sample["input_ids"].long()
        # SpecForge's training step: preprocess shifts the target states left by one, then the head.
        input_ids, target, _ = head.preprocess(data["input_ids"][None], data["hidden_state"], data["loss_mask"][None])
        theirs = head(target)[0, :-2]  # row j: the state at token j + 1, predicting token j + 2
        mine = ours_head.log_probs(sample["hidden_states"], normed=False).argmax(-1)[:-1]  # row j predicts j + 1
        ours_agree = (mine == ids[1:])[1:]
        assert torch.equal(input_ids[0, :-1], ids[1:])
        # the stored token is SpecForge's top-1 (its bf16 head may tie it with another: still its top-1 logit)
        stored_logit = theirs.gather(1, ids[2:, None])[:, 0]
        assert torch.equal(stored_logit[ours_agree], theirs.max(-1).values[ours_agree])
        assert bool(ours_agree[sample["loss_mask"][2:].bool()].all())  # greedy continuations, as our probe finds
        agreed += int(ours_agree.sum())
    assert agreed > 200


def test_draft_config_and_vocab_mapping_load_as_configured(built):
    export_dir = built / "export" / "raw"
    cfg = load_config(str(export_dir / "specforge.yaml"), CPU_OVERRIDES)
    provider = resolve_run(cfg).algorithm.providers.model.draft_config
    draft_config = resolve_draft_config(cfg, provider=provider)
    generated = _generate_draft_config(cfg, provider).to_dict()
    ours_config = draft_config.to_dict()
    vocab = json.loads((built / "vocab" / "vocab.json").read_text())
    assert ours_config.pop("draft_vocab_size") == vocab["draft_vocab_size"] == 256
    assert generated.pop("draft_vocab_size") == 32000  # SpecForge's default without our config
    assert ours_config.pop("eagle_config") == {"eagle_aux_hidden_state_layer_ids": [1, 3, 4]}  # layers [2, 4, 5]
    assert ours_config == generated  # otherwise the draft SpecForge itself would derive from the target
    draft = build_eagle3_draft(cfg, draft_config)
    assert draft.vocab_mapping_loaded
    assert torch.equal(draft.d2t, torch.from_numpy(np.load(built / "vocab" / "d2t.npy")))
    assert torch.equal(draft.t2d, torch.from_numpy(np.load(built / "vocab" / "t2d.npy")))
    with safe_open(str(built / "model" / "model.safetensors"), "pt") as f:
        embedding = f.get_tensor("model.embed_tokens.weight")
    assert torch.equal(draft.embed_tokens.weight.float(), embedding.to(torch.bfloat16).float())


def train_losses(output: str) -> list[float]:
    return [ast.literal_eval(m.group(1))["loss"] for m in re.finditer(r"^step \d+: (\{.*\})$", output, re.M)]


def test_specforge_train_on_the_export_lowers_the_loss(built, tmp_path):
    steps = 6
    command = [str(Path(sys.executable).parent / "specforge"), "train", "--config"]
    command += [str(built / "export" / "raw" / "specforge.yaml"), *CPU_OVERRIDES]
    # The whole export in every batch: the loss on the same batch must fall.
    command += [f"training.max_steps={steps}", f"training.num_epochs={steps}", "training.batch_size=16"]
    command += ["training.learning_rate=0.01", "training.warmup_ratio=0", "training.lr_scheduler=constant"]
    command += ["training.log_interval=1", f"output_dir={tmp_path / 'out'}", f"data.cache_dir={tmp_path / 'cache'}"]
    env = cpu_env(dict(os.environ))
    proc = subprocess.run(command, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    losses = train_losses(proc.stdout)
    assert len(losses) == steps
    assert losses[-1] < 0.8 * losses[0], losses
