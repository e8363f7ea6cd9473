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
It also prints the figures per 1,000 prompts, which carry over to the full datasets, and the disk and
capture of --scale-tokens tokens in --scale-samples samples (default 300M in 100k: the issue's Kimi run)
with each config's storage settings, at the ratios assumed before capture (formats/storage.py).

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

from eagle3_datagen.config_schema import fill_defaults
from eagle3_datagen.formats import storage
from eagle3_datagen.formats.files import iter_records
from eagle3_datagen.formats.trainer_exports import EXPORTS
from eagle3_datagen.reporting.plan import capture_rates, format_plan
from tests.doubles.tiktoken_slow import write_remote_code_dir

REPO = Path(__file__).resolve().parents[1]
WORKFLOW = ("Snakefile", "rules", "scripts", "envs", "profiles", "config", "config.yaml", "report")
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
    for key, label in (("generation_node_hours", "generation node-hours"), ("hidden_node_hours", "hidden node-hours")):
        if total.get(key) is not None:
            parts.append(f"{total[key] * scale:.2f} {label}")
    parts.append(f"{total['hidden_bytes'] * scale / (1 << 30):,.1f} GiB of hidden-state shards")
    parts.append(f"{total['end_bytes'] * scale / (1 << 30):,.1f} GiB kept at the end")
    return "per 1,000 prompts: " + ", ".join(parts)


def at_scale(config_name: str, tokens: int, samples: int) -> dict:
    """The config's states at `tokens` tokens in `samples` samples: bytes of each output, at most at once
    and at the end, and the capture's hours at the slower of its forward passes and its CPU side."""
    config = fill_defaults(yaml.safe_load((REPO / "config" / f"{config_name}.yaml").read_text()))
    hidden = config["hidden_states"]
    states = storage.States.from_settings(hidden, 3, config["plan"]["model"]["hidden_size"])
    ratio = storage.assumed_shard_ratio(hidden["dtype"], hidden["compress"], hidden["compress_level"])
    shards = sum(p["shards"] for p in config["partitions"].values())
    parts = tokens * storage.shard_bytes_per_token(hidden["dtype"], hidden["scales"], hidden["scale_block"], 3,
                                                   states.hidden_size) // hidden["shard_bytes"]  # fmt: skip
    exports = {}
    for fmt in config["export"]["formats"]:
        files = EXPORTS[fmt].files
        gzip_ratio = states.assumed_gzip_ratio(files) if EXPORTS[fmt].gzipped(config) else None
        exports[fmt] = states.export_bytes(files, tokens, samples, gzip_ratio)
    shard_bytes = states.shard_bytes(tokens, samples, parts, ratio, shards)
    bf16 = tokens * states.bf16_bytes_per_token
    end = sum(exports.values()) + (0 if not hidden["keep_shards"] and exports else shard_bytes)
    per_token = storage.shard_bytes_per_token(hidden["dtype"], hidden["scales"], hidden["scale_block"], 3,
                                              states.hidden_size)  # fmt: skip
    rates = capture_rates(config, per_token, (config["plan"].get("throughput") or {}).get("prefill_tokens_per_s"))
    cpu_per_core = storage.capture_bytes_per_core_s(hidden["dtype"], hidden["compress"], hidden["compress_level"])
    return {
        "tokens": tokens,
        "samples": samples,
        "bf16_bytes": bf16,
        "shard_bytes": shard_bytes,
        "export_bytes": exports,
        "peak_bytes": shard_bytes + sum(exports.values()),
        "end_bytes": end,
        "end_over_bf16": end / bf16,
        "capture": rates,
        "capture_node_hours": tokens / rates["tokens_per_s"] / 3600,
        "cpu_cores_at_forward_rate": rates.get("gpu_tokens_per_s", 0) * per_token / cpu_per_core,
    }


def scale_table(scaled: dict[str, dict]) -> str:
    tb = 1e12
    lines = [
        "| config | states in bf16 | shards (at most, then released) | exports | at most at once | at the end "
        "| capture node-hours (bound by) | CPU cores at 40k tokens/s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, row in scaled.items():
        exports = ", ".join(f"{fmt} {size / tb:.1f} TB" for fmt, size in row["export_bytes"].items())
        lines.append(
            f"| {name} | {row['bf16_bytes'] / tb:.1f} TB | {row['shard_bytes'] / tb:.1f} TB | {exports} | "
            f"{row['peak_bytes'] / tb:.1f} TB | {row['end_bytes'] / tb:.1f} TB ({row['end_over_bf16']:.2f}x bf16) | "
            f"{row['capture_node_hours']:.1f} ({row['capture']['bound_by']}) | {row['cpu_cores_at_forward_rate']:.1f} |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", choices=CONFIGS, action="append", help="an example config (default: both)")
    p.add_argument("--copies", type=int, default=1, help="times each real record is written (default 1)")
    p.add_argument("--shards", type=int, help="shards per partition instead of the config's (e.g. 1 for a quick run)")
    p.add_argument("--json", action="store_true", help="print the plans as JSON instead of tables")
    p.add_argument("--scale-tokens", type=float, default=300e6, help="tokens of the run at scale (default 300M)")
    p.add_argument("--scale-samples", type=int, default=100_000, help="its samples (default 100k)")
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
    scaled = {name: at_scale(name, int(args.scale_tokens), args.scale_samples) for name in args.config or CONFIGS}
    if args.json:
        print(json.dumps({**plans, "at_scale": scaled}, indent=2))
    else:
        print(f"#### {args.scale_tokens:,.0f} tokens in {args.scale_samples:,} samples\n\n{scale_table(scaled)}")


if __name__ == "__main__":
    main()
