#!/usr/bin/env python
"""Print `scripts/plan.py` for the Kimi-K2.5 example configs, on stand-ins for what is not here.

The configs are used as shipped (sampling, max tokens, prices, hidden-state layout, throughput,
model shape) except for two inputs this machine lacks:
- the model directory: Kimi-K2.5's real tokenizer files and template (`resources/kimi-k2.5`) with
  the project's remote-code tiktoken tokenizer in place of Moonshot's (`tests.doubles.tiktoken_slow`),
  so prompt token counts are Kimi's;
- the raw datasets: the demo's conversations written in each partition's format (glaive's
  `chat` text for B1_glaive, instruction/response records for B3_magicoder).
It also prints the figures per 1,000 prompts, which carry over to the real datasets.

  python bench/kimi_plan.py
"""

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from eagle3_datagen.formats.datasets import PARSERS
from eagle3_datagen.reporting.plan import format_plan
from tests.doubles.tiktoken_slow import write_remote_code_dir

REPO = Path(__file__).resolve().parents[1]
WORKFLOW = ("Snakefile", "rules", "schemas", "scripts", "envs", "profiles", "config", "config.yaml", "report")
DEMO_SOURCES = {"sharegpt.jsonl": "sharegpt", "openai.jsonl": "openai", "alpaca.json": "alpaca"}
CONFIGS = ("kimi-k2.5-sglang", "kimi-k2.5-openrouter")


def demo_conversations() -> list[list[dict]]:
    conversations = []
    for name, fmt in DEMO_SOURCES.items():
        text = (REPO / "resources/demo/data" / name).read_text()
        records = json.loads(text) if name.endswith(".json") else [json.loads(line) for line in text.splitlines()]
        conversations += [PARSERS[fmt](record) for record in records]
    return [c for c in conversations if any(m["role"] == "user" for m in c)]


def write_sources(conversations: list[list[dict]], data: Path) -> None:
    data.mkdir(parents=True)
    glaive = []
    for messages in conversations:
        system = " ".join(m["content"] for m in messages if m["role"] == "system")
        chat = " ".join(
            f"{'USER' if m['role'] == 'user' else 'ASSISTANT'}: {m['content']}"
            + (" <|endoftext|>" if m["role"] == "assistant" else "")
            for m in messages
            if m["role"] in ("user", "assistant")
        )
        glaive.append({"system": f"SYSTEM: {system}" if system else "", "chat": chat})
    (data / "glaive-function-calling-v2.json").write_text(json.dumps(glaive))
    with (data / "magicoder-evol-instruct.jsonl").open("w") as f:
        for messages in conversations:
            users = [m["content"] for m in messages if m["role"] == "user"]
            f.write(json.dumps({"instruction": users[0], "response": ""}) + "\n")


def plan_for(config_name: str, work: Path) -> dict:
    config = yaml.safe_load((REPO / "config" / f"{config_name}.yaml").read_text())
    config["model"]["path"] = str(work / "models/Kimi-K2.5")
    for source in config["partitions"].values():
        source["source"] = str(work / "data/raw" / Path(source["source"]).name)
    derived = work / f"{config_name}.yaml"
    derived.write_text(yaml.safe_dump(config, sort_keys=False))
    command = [sys.executable, "scripts/plan.py", "--configfile", str(derived), "--profile", "profiles/gpu", "--json"]
    return json.loads(subprocess.run(command, cwd=work, capture_output=True, text=True, check=True).stdout)


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
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for name in WORKFLOW:
            (shutil.copytree if (REPO / name).is_dir() else shutil.copy2)(REPO / name, work / name)
        write_remote_code_dir(REPO / "resources/kimi-k2.5", work / "models/Kimi-K2.5")
        write_sources(demo_conversations(), work / "data/raw")
        for name in CONFIGS:
            plan = plan_for(name, work)
            print(f"### config/{name}.yaml\n\n{format_plan(plan)}\n\n{per_thousand(plan)}\n")
            shutil.rmtree(work / "results")
            shutil.rmtree(work / ".snakemake", ignore_errors=True)


if __name__ == "__main__":
    main()
