#!/usr/bin/env python
"""Capture throughput on the CPU: the `sglang` backend (SGLang 0.5.23's runner) against `hf`.

Both capture the same random token sequences from the same random Qwen3 (gpu_check's model:
8 layers, hidden 512), in float32, with the same token budget per forward pass; reports tokens/s
of each and their ratio. The load (imports, model) is timed apart from the capture.

Usage (from the repository root; SGLang's CPU env and its import-only shims on the path):
  SGLANG_USE_CPU_ENGINE=1 SGLANG_EXTERNAL_MODEL_PACKAGE=sglang_test_models \\
  PYTHONPATH=tests/real_sglang/cpu .venv-sglang/bin/python bench/sglang_capture_cpu.py
"""

import argparse
import json
import tempfile
import time
from pathlib import Path

from eagle3_datagen.backends.base import SingleProcess
from eagle3_datagen.backends.batching import capture_in_batches
from eagle3_datagen.backends.hf.capture import HFCapture
from eagle3_datagen.backends.sglang.capture import (
    CPU_SERVER_FLAGS,
    SGLangCapture,
    SGLangModelRunner,
    server_flags,
)
from eagle3_datagen.config_schema import fill_defaults
from eagle3_datagen.diagnostics.gpu_check import random_batch, write_check_model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=32)
    p.add_argument("--max-batch-tokens", type=int, default=2048)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as work:
        model = write_check_model(Path(work) / "model")
        start = time.perf_counter()
        settings = fill_defaults(
            {
                "dtype": "float32",
                "mem_fraction_static": 0.5,  # the cache is capped below; see tests/real_sglang/conftest.py
                "server_args": {"max_total_tokens": 4 * args.max_batch_tokens},
            },
            "hidden_states.sglang",
        )
        runner = SGLangModelRunner([*server_flags(model, settings, False, args.max_batch_tokens, 1), *CPU_SERVER_FLAGS])
        load_s = time.perf_counter() - start
        batch = random_batch(runner.hf_config.vocab_size, args.samples, lo=64, hi=512)
        tokens = sum(map(len, batch))
        captures = {
            "sglang": SGLangCapture(runner, "auto", "normed", ranks=SingleProcess()),
            "hf": HFCapture(model, "auto", "normed", {"dtype": "float32", "device": "cpu"}),
        }
        result = {"tokens": tokens, "sglang_load_s": round(load_s, 1)}
        for name, capture in captures.items():
            start = time.perf_counter()
            capture_in_batches(capture, batch, args.max_batch_tokens)
            result[f"{name}_tokens_per_s"] = round(tokens / (time.perf_counter() - start))
        result["sglang_over_hf"] = round(result["sglang_tokens_per_s"] / result["hf_tokens_per_s"], 2)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
