"""scripts/gpu_check.py on the CPU, as the GPU node runs it, with the tiny DeepseekV3 (MLA + MoE,
Kimi-K2.5's architecture, whose auxiliary states SGLang hands over packed): SGLang's states equal
transformers' layer by layer."""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_gpu_check_on_the_cpu_compares_a_deepseek_v3_layer_by_layer(tiny_deepseek_dir, tmp_path):
    out = tmp_path / "check.json"
    proc = subprocess.run(
        [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
            str(REPO / "scripts" / "gpu_check.py"), "--device", "cpu", "--dtype", "float32",
            "--model", str(tiny_deepseek_dir), "--samples", "4", "--max-batch-tokens", "64", "--out", str(out),
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    table = [line for line in proc.stdout.splitlines() if line.strip()]
    assert table[0].split()[:2] == ["layer", "tokens"]
    assert [line.split("  ")[0].strip() for line in table[1:]] == [
        "aux hidden_states[2]",
        "aux hidden_states[4]",
        "aux hidden_states[5]",
        "final (normed)",
        "final (raw)",
    ]
    records = json.loads(out.read_text())
    assert records["ok"]
    assert all(r["ok"] and r["max_abs"] < 1e-4 and r["min_cosine"] > 0.9999 for r in records["layers"]), records
