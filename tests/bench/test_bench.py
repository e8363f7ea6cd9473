"""Every bench script runs at tiny sizes, so that a refactor cannot break one unseen.

These are smoke runs: the numbers they print are not asserted (the machine is noisy), but each
run must finish, exit 0 and print the rows its README/BENCHMARKS tables are made of. The models
are tiny ones built here (nothing downloaded): a random Qwen3 with Qwen3's real tokenizer and a
random tiny Kimi (DeepseekV3) with Kimi-K2.5's real tokenizer files. `bench/sglang_capture_cpu.py`
needs SGLang: its smoke run is in tests/real_sglang/test_bench.py. `bench/kimi_plan.py` has its
own, tests/bench/test_bench_kimi_plan.py.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from transformers import Qwen3ForCausalLM

from eagle3_datagen.formats.files import write_jsonl_zst
from tests.helpers import REPO


def bench(script: str, *args: str) -> str:
    """Run a bench script as its docstring says: from the repository root, the venv on PATH."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    command = [sys.executable, str(REPO / "bench" / script), *args]
    proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{script} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


@pytest.fixture(scope="module")
def qwen_model_dir(tmp_path_factory, qwen_tokenizer) -> Path:
    """A random Qwen3 of the demo's sizes (config.yaml: 8 layers, hidden 64), not fitted, beside
    Qwen3's real tokenizer and the demo's template."""
    from eagle3_datagen.targets.demo import tiny_qwen3_config

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("bench-qwen") / "model"
    settings = yaml.safe_load((REPO / "config.yaml").read_text())["demo"]
    model = Qwen3ForCausalLM(tiny_qwen3_config(len(qwen_tokenizer), settings))
    model.generation_config.eos_token_id = qwen_tokenizer.convert_tokens_to_ids("<|im_end|>")
    model.generation_config.pad_token_id = qwen_tokenizer.pad_token_id
    model.save_pretrained(path)
    qwen_tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def kimi_model_dir(tmp_path_factory) -> Path:
    """A random tiny Kimi-architecture model (config/tiny-kimi.yaml's sizes), not fitted."""
    from eagle3_datagen.chat.tiktoken_fast import fast_tokenizer_from_tiktoken
    from eagle3_datagen.targets.tiny_kimi import tiny_kimi_config, tiny_kimi_model, write_kimi_model_dir

    settings = yaml.safe_load((REPO / "config" / "tiny-kimi.yaml").read_text())["demo"]
    tokenizer_dir = REPO / "resources" / "kimi-k2.5"
    config = tiny_kimi_config(settings, fast_tokenizer_from_tiktoken(tokenizer_dir))
    path = tmp_path_factory.mktemp("bench-kimi") / "model"
    write_kimi_model_dir(path, tiny_kimi_model(config, seed=0), config, tokenizer_dir, {})
    return path


@pytest.fixture(scope="module")
def token_results(tmp_path_factory) -> Path:
    """A results/ directory with one token shard, as the tokens stage writes them."""
    results = tmp_path_factory.mktemp("bench-results")
    samples = [
        {"id": f"s{i}", "input_ids": list(range(100 + i, 140 + 3 * i)), "loss_mask": [0] * 20 + [1] * (20 + 2 * i)}
        for i in range(4)
    ]
    write_jsonl_zst(results / "p" / "tokens" / "00000.jsonl.zst", samples)
    return results


def test_api_concurrency():
    out = bench("api_concurrency.py", "--prompts", "12", "--concurrency", "4", "--latency", "0.01")
    rows = [line for line in out.splitlines() if line.startswith("| 4 |")]
    assert len(rows) == 2 and all(row.split("|")[3].strip() == "12" for row in rows)  # every prompt ok


def test_dryrun_scale():
    out = bench("dryrun_scale.py", "--partitions", "2", "--shards", "2", "--repeats", "1")
    assert out.startswith("partitions=2 shards=2 jobs=") and "dry-run seconds" in out


def test_tokens_throughput():
    out = bench("tokens_throughput.py", "--conversations", "6", "--workers", "2", "--per-length", "2")
    assert "fast / slow samples/s" in out and "tokenizers disagree" not in out and "quality gates: " in out
    assert [line.split("|")[1].strip() for line in out.splitlines()[-4:]] == ["1", "2", "4", "8"]


def test_hidden_bytes(qwen_model_dir, token_results):
    out = bench(
        "hidden_bytes.py", "--samples", "6", "--results", str(token_results), "--model", str(qwen_model_dir),
        "--levels", "1",
    )  # fmt: skip
    assert out.startswith("6 samples") and "(1) packed" in out and "| 1 |" in out


def test_probe_cost(qwen_model_dir, token_results):
    out = bench("probe_cost.py", "--results", str(token_results), "--model", str(qwen_model_dir), "--repeats", "1")
    assert out.startswith("1 shards") and "probe / hidden" in out


def test_hidden_storage(qwen_model_dir, kimi_model_dir):
    out = bench(
        "hidden_storage.py", "--demo-model", str(qwen_model_dir), "--kimi-model", str(kimi_model_dir),
        "--samples", "2", "--new-tokens", "4",
    )  # fmt: skip
    assert out.count("\n### ") == 4 and "| bf16 aux states, zstd level 3 |" in out


def test_states_cpu(tmp_path):
    out = bench(
        "states_cpu.py", "--tokens", "256", "--sample-tokens", "64", "--part-mb", "1", "--hidden", "128",
        "--zstd-mb", "1", "--work", str(tmp_path),
    )  # fmt: skip
    sections = [json.loads(chunk) for chunk in re.split(r"\n(?=\{)", out.strip())]
    assert [next(iter(s)) for s in sections] == ["tokens", "capture", "overlap", "export", "read", "zstd"]
    assert sections[1]["capture"]["zstd_planes"]["cores_at_target"] > 0
    assert sections[2]["overlap"]["stage_over_forward"] >= 1.0
    # the codec's frame is zstd's single-threaded one
    assert sections[5]["zstd"]["bf16 states"]["single-threaded"]["same_bytes_as_single"] is True


def test_fresh_clone_demo_script_parses():
    """bench/fresh_clone_demo.sh times `make demo` on a fresh clone: it cannot run at a tiny size
    (the demo is its subject; the e2e tier runs the demo itself), so only its syntax is checked."""
    subprocess.run(["bash", "-n", str(REPO / "bench" / "fresh_clone_demo.sh")], check=True)
