"""The unit tier's fixtures: Kimi-K2.5's tokenizer, loaded each way it is shipped; a stand-in nvidia-smi."""

import json
import os
import sys
from pathlib import Path

import pytest

from tests.helpers import KIMI_FILES, REPO


@pytest.fixture(scope="session")
def kimi_fast():
    """Kimi-K2.5's real tokenizer as a fast tokenizer built from its files, with K2.5's template."""
    from eagle3_datagen.chat.tiktoken_fast import fast_tokenizer_from_tiktoken

    return fast_tokenizer_from_tiktoken(KIMI_FILES)


@pytest.fixture(scope="session")
def kimi_fast_dir(tmp_path_factory, kimi_fast) -> Path:
    """A model directory holding that fast tokenizer (tokenizer.json), loaded without remote code."""
    path = tmp_path_factory.mktemp("kimi-fast") / "model"
    kimi_fast.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def kimi_remote_code_dir(tmp_path_factory) -> Path:
    """A model directory laid out like a real Kimi-K2.5 one: Kimi's `tiktoken.model`, tokenizer
    config and template, and a remote-code slow tokenizer that `auto_map` names. Moonshot's own
    `tokenization_kimi.py` cannot be vendored, so the project's own tiktoken tokenizer stands in."""
    from tests.doubles.tiktoken_slow import write_remote_code_dir

    return write_remote_code_dir(KIMI_FILES, tmp_path_factory.mktemp("kimi-remote") / "model")


@pytest.fixture(scope="session")
def kimi_slow(kimi_remote_code_dir):
    from eagle3_datagen.chat.template import load_tokenizer

    return load_tokenizer(kimi_remote_code_dir, trust_remote_code=True)


@pytest.fixture
def stand_in_nvidia_smi(tmp_path, monkeypatch):
    """A stand-in `nvidia-smi` first on PATH (no GPU here): two 80 GiB GPUs, GPU 1 held by the processes the
    test writes into the returned state file."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text(f'#!/bin/sh\nexec {sys.executable} {REPO / "tests/doubles/nvidia_smi.py"} "$@"\n')
    smi.chmod(0o755)
    state = tmp_path / "gpus.json"
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("E3DG_NVIDIA_SMI_STATE", str(state))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)

    def holding(holders: list[dict]) -> None:
        gpus_ = [{"index": i, "uuid": f"GPU-{i}", "total": 81559} for i in range(2)]
        state.write_text(json.dumps({"gpus": gpus_, "holders": holders}))

    return holding
