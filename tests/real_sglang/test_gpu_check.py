"""scripts/gpu_check.py on the CPU, as the GPU node runs it, with the tiny DeepseekV3 (MLA + MoE,
Kimi-K2.5's architecture, whose auxiliary states SGLang hands over packed): SGLang's states equal
transformers' layer by layer, on the whole model and on the slice a node too small for two copies of
the model loads (its first 7 layers, diagnostics/model_slice.py)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("layers", "said", "aux"),
    [
        (None, "checking the whole model, 8 layers", [2, 4, 5]),
        (7, "checking the first 7 of 8 layers", [2, 3, 4]),
    ],
)
def test_gpu_check_on_the_cpu_compares_a_deepseek_v3_layer_by_layer(tiny_deepseek_dir, tmp_path, layers, said, aux):
    out = tmp_path / "check.json"
    proc = subprocess.run(
        [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
            str(REPO / "scripts" / "gpu_check.py"), "--device", "cpu", "--dtype", "float32",
            "--model", str(tiny_deepseek_dir), "--samples", "4", "--max-batch-tokens", "64", "--out", str(out),
            *(["--layers", str(layers)] if layers else []),
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    printed = [line for line in proc.stdout.splitlines() if line.strip()]
    assert printed[0].startswith(said)
    assert printed[1].split()[:2] == ["layer", "tokens"]
    assert [line.split("  ")[0].strip() for line in printed[2:]] == [
        *(f"aux hidden_states[{i}]" for i in aux),
        "final (normed)",
        "final (raw)",
    ]
    records = json.loads(out.read_text())
    assert records["ok"] and records["checked"]["layers"] == (layers or 8)
    assert all(r["ok"] and r["max_abs"] < 1e-4 and r["min_cosine"] > 0.9999 for r in records["layers"]), records
    if layers:  # both engines loaded the slice: its config, its tensors
        assert records["checked"]["bytes"] < records["checked"]["checkpoint_bytes"]
        assert Path(records["checked"]["model"]).name == "slice"
