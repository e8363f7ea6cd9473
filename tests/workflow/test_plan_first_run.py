"""`python scripts/plan.py` where a user first tries it: a fresh copy of the demo (no model built yet), a
Kimi example config as shipped on a machine without the model (plan.model and plan.tokenizer), and a
prompts job that fails inside the plan. Each runs real Snakemake prompts jobs: the e2e tier."""

import json
import sys
from pathlib import Path

import pytest
import yaml

from tests.helpers import copy_workflow, kimi_sources, run

pytestmark = pytest.mark.e2e


def plan(work: Path, *args: str, check=True):
    return run([sys.executable, "scripts/plan.py", *args], work, check=check)


def test_the_plan_on_a_fresh_demo_needs_no_built_model(tmp_path):
    work = copy_workflow(tmp_path / "wf")
    out = json.loads(plan(work, "--json").stdout)
    assert not (work / "results/demo/model").exists()
    # each partition's baseline twin (evaluate.baseline: original) reads its prompts and generates nothing
    prompts = {"demo_alpaca": 26, "demo_openai": 21, "demo_sharegpt": 24}
    assert {row["partition"]: row["prompts"] for row in out["partitions"]} == {
        **prompts,
        **{f"{p}+original": n for p, n in prompts.items()},
    }
    assert {row["partition"]: row["backend"] for row in out["partitions"]}["demo_alpaca+original"] == "dataset"
    # the demo's shape (8 layers: aux 2, 4, 5 and the final, hidden 64, bf16, uncompressed) and Qwen3's tokens
    assert {row["hidden_basis"] for row in out["partitions"]} == {
        "bfloat16, 517 B/token; shards: bfloat16 none x 1.000 (uncompressed)"
    }
    assert out["total"]["prompt_tokens"] == 2 * 2259
    assert json.loads((work / "results/plan.json").read_text()) == out


def test_the_plan_on_a_kimi_config_without_the_model_counts_kimis_tokens(tmp_path):
    work = copy_workflow(tmp_path / "wf")
    kimi_sources(work)
    args = ["--configfile", "config/kimi-k2.5-sglang.yaml", "--profile", "profiles/gpu", "--json"]
    out = json.loads(plan(work, *args).stdout)
    rows = {row["partition"]: row for row in out["partitions"]}
    # the same counts as through the remote-code tokenizer in a model directory (bench/kimi_plan.py)
    assert {name: row["prompt_tokens"] for name, row in rows.items()} == {
        "B1_glaive": 320,
        "B3_magicoder_evol": 159,
        "B3_magicoder_oss": 251,
    }
    # the config's storage before any shard: byte planes at zstd level 1, gzipped SpecForge rows, ratios assumed
    assert {row["hidden_basis"] for row in rows.values()} == {
        "bfloat16, 57349 B/token; shards: bfloat16 zstd_planes x 0.690 (assumed); specforge: gzip x 0.810 (assumed)"
    }


def test_the_plan_under_shared_across_partitions_drop_builds_every_partitions_prompts(tmp_path):
    """With `drop` each partition's prompts rule reads the earlier partitions' shards: the plan builds them
    in order (an `--until` of the three rules stopped after the first) and counts every partition."""
    work = copy_workflow(tmp_path / "wf")
    config = yaml.safe_load((work / "config.yaml").read_text())
    config.setdefault("prompts", {})["shared_across_partitions"] = "drop"
    (work / "drop.yaml").write_text(yaml.safe_dump(config))
    out = json.loads(plan(work, "--json", "--configfile", "drop.yaml").stdout)
    # the demo's three sources share no prompt: dropping leaves each partition's count as under keep
    counts = {row["partition"]: row["prompts"] for row in out["partitions"]}
    assert {p: counts[p] for p in ("demo_alpaca", "demo_openai", "demo_sharegpt")} == {
        "demo_alpaca": 26,
        "demo_openai": 21,
        "demo_sharegpt": 24,
    }
    assert all((work / f"results/{p}/prompts/stats.json").is_file() for p in ("demo_openai", "demo_sharegpt"))


def test_a_prompts_job_that_fails_inside_the_plan_says_why(tmp_path):
    work = copy_workflow(tmp_path / "wf")
    (work / "resources/demo/data/sharegpt.jsonl").write_text('{"conversations": []}\n[1]\n')
    proc = plan(work, check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    last = proc.stderr.splitlines()[-1]
    assert last.startswith("error: snakemake prompts_demo_sharegpt prompts_demo_openai prompts_demo_alpaca --profile")
    assert last.endswith(
        "resources/demo/data/sharegpt.jsonl:2: expected a JSON object, got list; 1 of 2 records could not be read"
        " (allowed: 0.00%). Fix: make each line one JSON object, or raise the partition's max_bad_record_rate to"
        " drop them"
    )
