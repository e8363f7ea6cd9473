#!/usr/bin/env python
"""Print `scripts/plan.py` for the Kimi-K2.5 example configs, on the real tokenizer and real records.

The configs are used as shipped (partitions and their formats, sampling, max tokens, prices,
hidden-state layout, throughput, model shape) except for two inputs this machine lacks:
- the model directory: Kimi-K2.5's own tokenizer files and chat template (`resources/kimi-k2.5`:
  tiktoken.model, tokenizer_config.json, chat_template.jinja), loaded through the remote-code
  tokenizer `tests.doubles.tiktoken_slow` (Moonshot's tokenization_kimi.py is not vendored; the IDs
  are tiktoken's over Kimi's ranks, so prompt token counts are Kimi's);
- the raw datasets: each partition's source is written from the verbatim records of its dataset in
  tests/fixtures/realdata (B1_glaive: glaive-function-calling-v2's `system`/`chat` rows as the
  config's JSON array; B3_magicoder_evol and B3_magicoder_oss: Magicoder's JSON lines), in the
  layout the config names. `--copies N` writes each record N times (the prompts stage keeps one of
  each: the plan counts distinct prompts).
It also prints the figures per 1,000 prompts, which carry over to the full datasets.

  python bench/kimi_plan.py                       # both configs, as shipped
  python bench/kimi_plan.py --config kimi-k2.5-sglang --shards 1   # one config, one shard per partition
  python bench/kimi_plan.py --profile profiles/slurm               # as a SLURM run would load its models
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from eagle3_datagen.formats.files import iter_records
from eagle3_datagen.reporting.plan import format_plan
from tests.doubles.tiktoken_slow import write_remote_code_dir

REPO = Path(__file__).resolve().parents[1]
WORKFLOW = ("Snakefile", "rules", "schemas", "scripts", "envs", "profiles", "config", "config.yaml", "report")
REALDATA = REPO / "tests/fixtures/realdata"
# Each example partition's dataset, as tests/fixtures/realdata holds its records.
SOURCES = {
    "B1_glaive": "glaive_function_calling_v2.jsonl",
    "B3_magicoder_evol": "magicoder_evol_instruct_110k.jsonl",
    "B3_magicoder_oss": "magicoder_oss_instruct_75k.jsonl",
}
CONFIGS = ("kimi-k2.5-sglang", "kimi-k2.5-openrouter")


def write_source(records: Path, target: Path, copies: int) -> None:
    """The dataset's records in the container the config's source names (.json array or JSON lines)."""
    rows = [record for _, record in iter_records(records)] * copies
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.name.endswith(".json"):
        target.write_text(json.dumps(rows, ensure_ascii=False))
    else:
        target.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))


def plan_for(config_name: str, work: Path, copies: int, shards: int | None, profile: str) -> dict:
    config = yaml.safe_load((REPO / "config" / f"{config_name}.yaml").read_text())
    config["model"]["path"] = str(work / "models/Kimi-K2.5")
    for name, partition in config["partitions"].items():
        partition["source"] = str(work / "data/raw" / Path(partition["source"]).name)
        write_source(REALDATA / SOURCES[name], Path(partition["source"]), copies)
        if shards is not None:
            partition["shards"] = shards
    derived = work / f"{config_name}.yaml"
    derived.write_text(yaml.safe_dump(config, sort_keys=False))
    command = [sys.executable, "scripts/plan.py", "--configfile", str(derived), "--profile", profile, "--json"]
    # The rules' `python` is this environment's, as with an activated venv.
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    proc = subprocess.run(command, cwd=work, capture_output=True, text=True, env=env)
    if proc.returncode:
        raise SystemExit(f"scripts/plan.py failed on {config_name}:\n{proc.stdout}{proc.stderr}")
    return json.loads(proc.stdout)


def per_thousand(plan: dict) -> str:
    total = plan["total"]
    scale = 1000 / total["prompts"]
    parts = [f"{total['completion_tokens'] * scale:,.0f} completion tokens"]
    if total.get("cost_usd") is not None:
        parts.append(f"${total['cost_usd'] * scale:,.2f}")
    for key, label in (("generation_gpu_hours", "generation node-hours"), ("hidden_gpu_hours", "hidden node-hours")):
        if total.get(key) is not None:
            parts.append(f"{total[key] * scale:.2f} {label}")
    parts.append(f"{total['hidden_bytes'] * scale / (1 << 30):,.1f} GiB of hidden states")
    return "per 1,000 prompts: " + ", ".join(parts)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", choices=CONFIGS, action="append", help="an example config (default: both)")
    p.add_argument("--copies", type=int, default=1, help="times each real record is written (default 1)")
    p.add_argument("--shards", type=int, help="shards per partition instead of the config's (e.g. 1 for a quick run)")
    p.add_argument("--json", action="store_true", help="print the plans as JSON instead of tables")
    p.add_argument(
        "--profile",
        default="profiles/gpu",
        help="the run's profile (default profiles/gpu; profiles/slurm submits the prompts jobs to a SLURM cluster)",
    )
    args = p.parse_args()
    plans = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for name in WORKFLOW:
            (shutil.copytree if (REPO / name).is_dir() else shutil.copy2)(REPO / name, work / name)
        write_remote_code_dir(REPO / "resources/kimi-k2.5", work / "models/Kimi-K2.5")
        for name in args.config or CONFIGS:
            plans[name] = plan_for(name, work, args.copies, args.shards, args.profile)
            if not args.json:
                print(f"#### config/{name}.yaml\n\n{format_plan(plans[name])}\n\n{per_thousand(plans[name])}\n")
            shutil.rmtree(work / "results")
            shutil.rmtree(work / ".snakemake", ignore_errors=True)
    if args.json:
        print(json.dumps(plans, indent=2))


if __name__ == "__main__":
    main()
