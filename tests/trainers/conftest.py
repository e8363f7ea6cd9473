"""Tests that run a trainer's PyPI release, in its own venv (`make speculators-env`:
`.venv-speculators/bin/python -m pytest tests/trainers`). Every test here is marked `trainers`."""

import random
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from eagle3_datagen.backends.hf.capture import HFCapture
from eagle3_datagen.config_schema import fill_defaults
from eagle3_datagen.stages.export import export
from eagle3_datagen.stages.hidden.shard import capture_shard
from eagle3_datagen.stages.vocab import vocab_mapping
from tests.helpers import REPO, tiny_qwen3

DRAFT_VOCAB = 256


def pytest_collection_modifyitems(items):
    here = Path(__file__).parent
    for item in items:
        if here in Path(item.fspath).parents:
            item.add_marker(pytest.mark.trainers)


def greedy_samples(model, count: int, seed: int) -> list[dict]:
    """Random prompts and the model's own greedy continuations (loss-masked): data on which the
    LM head applied to the stored final state reproduces every trained token."""
    rng = random.Random(seed)
    samples = []
    for i in range(count):
        prompt = [rng.randrange(model.config.vocab_size) for _ in range(rng.randint(4, 12))]
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), max_new_tokens=rng.randint(12, 40), do_sample=False)
        ids = out[0].tolist()
        samples.append(
            {"id": f"g{i}", "input_ids": ids, "loss_mask": [0] * len(prompt) + [1] * (len(ids) - len(prompt))}
        )
    return samples


def tiny_kimi_dir(path: Path) -> Path:
    """A random tiny Kimi-K2.5-architecture verifier (DeepSeek-V3: MLA, MoE; Kimi's real tokenizer and
    163,840-token vocabulary), sized as config/tiny-kimi.yaml's demo."""
    import yaml

    from eagle3_datagen.chat.tiktoken_fast import fast_tokenizer_from_tiktoken
    from eagle3_datagen.targets.tiny_kimi import tiny_kimi_config, tiny_kimi_model, write_kimi_model_dir

    settings = yaml.safe_load((REPO / "config/tiny-kimi.yaml").read_text())["demo"]
    tokenizer_dir = REPO / settings["tokenizer"]
    config = tiny_kimi_config(settings, fast_tokenizer_from_tiktoken(tokenizer_dir))
    write_kimi_model_dir(path, tiny_kimi_model(config, seed=0).eval(), config, tokenizer_dir, {})
    return path


@pytest.fixture(scope="session", params=["qwen3", "tiny-kimi"])
def verifier_dir(request, tmp_path_factory) -> Path:
    """The demo's architecture (a random tiny Qwen3) and the tiny Kimi's."""
    path = tmp_path_factory.mktemp("verifier") / "model"
    if request.param == "tiny-kimi":
        return tiny_kimi_dir(path)
    torch.manual_seed(0)
    model = tiny_qwen3(512).eval()
    model.generation_config.pad_token_id = 0
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def captured(tmp_path_factory, verifier_dir) -> dict:
    """Two bf16 shards (`final: raw`, the default) of the verifier's greedy data, the vocab stage's
    mapping and the speculators export of both."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("captured")
    model = AutoModelForCausalLM.from_pretrained(verifier_dir).eval()
    model.generation_config.pad_token_id = model.config.pad_token_id or 0
    samples = greedy_samples(model, 24, seed=1)
    capture = HFCapture(verifier_dir, "auto", "raw", {"dtype": "float32", "device": "cpu"})
    settings = fill_defaults({"dtype": "bfloat16", "shard_bytes": 1 << 20, "max_batch_tokens": 256}, "hidden_states")
    shards = [root / "hidden" / "00000", root / "hidden" / "00001"]
    capture_shard(samples[:14], shards[0], capture, {**settings, "shard_bytes": 16_000})
    capture_shard(samples[14:], shards[1], capture, settings)
    vocab_size = model.config.vocab_size
    counts = np.zeros(vocab_size, dtype=np.int64)
    for s in samples:
        ids = np.asarray(s["input_ids"])
        counts += np.bincount(ids[np.asarray(s["loss_mask"], dtype=bool)], minlength=vocab_size)
    d2t, t2d = vocab_mapping(counts, DRAFT_VOCAB)
    vocab = root / "vocab"
    vocab.mkdir()
    np.save(vocab / "d2t.npy", d2t)
    np.save(vocab / "t2d.npy", t2d)
    out = root / "export" / "speculators"
    summary = export(shards, out, "speculators", model_path=verifier_dir, vocab_dir=vocab, draft_vocab_size=DRAFT_VOCAB)
    # The same samples stored fp8 (per-token scales), exported as fp8 for speculators' fp8 backend.
    fp8_shard = root / "hidden-fp8" / "00000"
    fp8 = {**settings, "dtype": "float8_e4m3", "scales": "token", "compress": "zstd", "shard_bytes": 16_000}
    capture_shard(samples, fp8_shard, capture, fp8)
    fp8_out = root / "export" / "speculators-fp8"
    export([fp8_shard], fp8_out, "speculators", model_path=verifier_dir, vocab_dir=vocab, draft_vocab_size=DRAFT_VOCAB)
    return {
        "shards": shards,
        "export": out,
        "summary": summary,
        "samples": samples,
        "vocab": vocab,
        "fp8_shard": fp8_shard,
        "fp8_export": fp8_out,
    }


@pytest.fixture(scope="session")
def specforge_build(tmp_path_factory):
    """build_specforge_export.py's output for an architecture ("demo" or "kimi"), built once per session
    by the project's own venv and shared by test_specforge.py and test_evaluate.py (neither changes it)."""
    built: dict[str, Path] = {}

    def build(arch: str) -> Path:
        if arch not in built:
            out = tmp_path_factory.mktemp(arch)
            command = [str(REPO / ".venv" / "bin" / "python"), str(Path(__file__).parent / "build_specforge_export.py")]
            subprocess.run([*command, "--arch", arch, "--out", str(out)], check=True, capture_output=True, cwd=REPO)
            built[arch] = out
        return built[arch]

    return build
