"""Smoke test of bench/kimi_plan.py: the plan on a Kimi example config as shipped (32 shards, --profile
gpu), with Kimi-K2.5's real tokenizer files (through the remote-code tokenizer double, Moonshot's code
not being vendored) and the real records of each partition's dataset."""

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_kimi_plan_runs_on_the_real_records_of_each_partition_and_loads_each_model_once():
    command = [sys.executable, "bench/kimi_plan.py", "--config", "kimi-k2.5-sglang", "--json"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    plan = out["kimi-k2.5-sglang"]
    # 300M tokens: one copy of the states stays, gzipped SpecForge rows (docs/plan.md's table)
    scaled = out["at_scale"]["kimi-k2.5-sglang"]
    assert scaled["bf16_bytes"] == 300_000_000 * 57_344 and scaled["end_over_bf16"] <= 1.0
    assert scaled["capture"]["bound_by"] == "gpu" and scaled["capture_node_hours"] > 2
    rows = {row["partition"]: row for row in plan["partitions"]}
    # tests/fixtures/realdata: 3 glaive rows, one Magicoder record of each half
    assert {name: row["prompts"] for name, row in rows.items()} == {
        "B1_glaive": 3,
        "B3_magicoder_evol": 1,
        "B3_magicoder_oss": 1,
    }
    # no response observed yet: 8192 max tokens per user turn (the glaive rows have 2 each)
    assert {name: row["completion_tokens"] for name, row in rows.items()} == {
        "B1_glaive": 6 * 8192,
        "B3_magicoder_evol": 8192,
        "B3_magicoder_oss": 8192,
    }
    assert all(row["prompt_tokens"] > 100 for row in rows.values())
    # 32 responses and 32 hidden-state shard jobs on one node: the server and the capture runner load once each
    loads = {model: load["loads"] for model, load in plan["loads"].items()}
    assert loads == {"generation_server": 1, "capture_runner": 1}
