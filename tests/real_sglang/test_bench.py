"""bench/sglang_capture_cpu.py at a tiny size, under SGLang 0.5.23 on the CPU (its numbers are not
asserted: the machine is noisy; the run must finish and print both backends' rows)."""

import json
import subprocess
import sys

from tests.helpers import REPO


def test_sglang_capture_cpu_bench_runs():
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "sglang_capture_cpu.py"), "--samples", "2", "--max-batch-tokens", "512"],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    result = json.loads(proc.stdout.splitlines()[-1])
    assert result["tokens"] >= 128 and result["sglang_tokens_per_s"] > 0 and result["hf_tokens_per_s"] > 0
