#!/usr/bin/env python
"""Does the plan predict the bytes a run writes? A copy of a finished workflow (the demo's) with its states
removed, rerun with the Kimi-K2.5 configs' storage settings, against what `scripts/plan.py` said first.

The copy keeps prompts, responses and tokens (so the plan counts measured tokens) and loses every
hidden-state shard, probe, export, the draft vocabulary and the report; its config takes the Kimi configs'
`hidden_states` storage keys (dtype, compress, compress_level, keep_shards) and `export` section, and drops
the evaluate stage (its drafts would retrain: minutes, no bytes of the states). Then: the plan (JSON), the run
(`snakemake --profile profiles/local`), and per partition the bytes the run wrote (the shards' index.json,
which stays when their parts are released; every file of each export), what stays at the end (every file
under the partition's hidden/ and export/), and the states' bf16 bytes; printed as JSON with the plan's
figures and the ratios (planned over written). Before capture the shards' compression ratio can only be
assumed; `after_first_shard` plans again with each partition's first shard kept (its index.json, which
gives the observed ratio) and the rest removed, against the same run's bytes.

Usage: python bench/disk_prediction.py --from DIR [--kimi config/kimi-k2.5-sglang.yaml] [--work DIR]
(DIR: a finished workflow directory, e.g. the repository after `make demo`).
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

REPO = Path(__file__).resolve().parents[1]
WORKFLOW = ("Snakefile", "rules", "scripts", "envs", "profiles", "config", "report", "resources")
STORAGE_KEYS = ("dtype", "compress", "compress_level", "keep_shards")
REMOVED = ("hidden", "probe", "export", "evaluate")


def prepare(source: Path, work: Path, kimi: dict) -> dict:
    """`work`: the workflow with `source`'s results and config, its states removed, Kimi's storage settings."""
    for name in WORKFLOW:
        (shutil.copytree if (REPO / name).is_dir() else shutil.copy2)(REPO / name, work / name)
    shutil.copytree(source / "results", work / "results", symlinks=True)
    shutil.copytree(source / ".snakemake", work / ".snakemake", ignore=shutil.ignore_patterns("conda", "log"))
    for partition in list((work / "results").iterdir()):
        for name in REMOVED:
            shutil.rmtree(partition / name, ignore_errors=True)
    for name in ("vocab", "report", "evaluate", "plan.json"):
        path = work / "results" / name
        shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
    config = yaml.safe_load((source / "config.yaml").read_text())
    config.pop("evaluate", None)
    config["hidden_states"].update(
        {key: kimi["hidden_states"][key] for key in STORAGE_KEYS if key in kimi["hidden_states"]}
    )
    config["export"] = kimi["export"]
    (work / "kimi-storage.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    return config


def files_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.exists() else 0


def disk_bytes(*paths: Path) -> int:
    """The bytes the files under `paths` hold on the disk: a file linked twice (an export and its kept copy
    under hidden/kept, a shard and its .finished copy) counts once."""
    inodes = {}
    for path in paths:
        for p in path.rglob("*") if path.exists() else ():
            if p.is_file() and not p.is_symlink():
                stat = p.stat()
                inodes[(stat.st_dev, stat.st_ino)] = stat.st_size
    return sum(inodes.values())


def measure(work: Path, plan: dict) -> dict:
    rows = {}
    for row in plan["partitions"]:
        partition = work / "results" / row["partition"]
        indexes = [json.loads(p.read_text()) for p in sorted(partition.glob("hidden/*/index.json"))]
        shards = sum(i["bytes"] for i in indexes)
        exports = {p.name: files_bytes(p) for p in sorted((partition / "export").iterdir())}
        end = disk_bytes(partition / "hidden", partition / "export")
        tokens = sum(i["tokens"] for i in indexes)
        bf16 = tokens * (len(indexes[0]["aux_layers"]) + 1) * indexes[0]["hidden_size"] * 2
        d = row["disk"]
        rows[row["partition"]] = {
            "tokens": tokens,
            "planned_tokens": d["tokens"],
            "shard_bytes": shards,
            "planned_shard_bytes": d["shard_bytes"],
            "shards_ratio": round(d["shard_bytes"] / shards, 3),
            "export_bytes": exports,
            "planned_export_bytes": d["export_bytes"],
            "exports_ratio": {f: round(d["export_bytes"][f] / b, 3) for f, b in exports.items()},
            "written": shards + sum(exports.values()),
            "planned_written": d["peak_bytes"],
            "written_ratio": round(d["peak_bytes"] / (shards + sum(exports.values())), 3),
            "end_bytes": end,
            "planned_end_bytes": d["end_bytes"],
            "end_ratio": round(d["end_bytes"] / end, 3),
            "bf16_bytes": bf16,
            "end_over_bf16": round(end / bf16, 3),
        }
    return rows


def replan_after_first_shard(work: Path, run: dict, env: dict, common: list[str]) -> dict:
    """The plan once each partition's first shard is captured (the rest of its states removed), against `run`."""
    for partition in (work / "results").iterdir():
        for shard in sorted(partition.glob("hidden/*"))[1:]:
            shutil.rmtree(shard) if shard.is_dir() else shard.unlink()
        for name in ("probe", "export"):
            shutil.rmtree(partition / name, ignore_errors=True)
    planned = subprocess.run(
        [sys.executable, "scripts/plan.py", *common, "--json"], cwd=work, env=env, capture_output=True, text=True
    )
    if planned.returncode:
        raise SystemExit(f"scripts/plan.py failed:\n{planned.stdout}{planned.stderr}")
    rows = {}
    for row in json.loads(planned.stdout)["partitions"]:
        written = run[row["partition"]]
        d = row["disk"]
        rows[row["partition"]] = {
            "planned_shard_bytes": d["shard_bytes"],
            "shards_ratio": round(d["shard_bytes"] / written["shard_bytes"], 3),
            "written_ratio": round(d["peak_bytes"] / written["written"], 3),
            "basis": d["basis"],
        }
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--from", dest="source", type=Path, required=True, help="a finished workflow directory")
    p.add_argument("--kimi", type=Path, default=REPO / "config/kimi-k2.5-sglang.yaml")
    p.add_argument("--work", type=Path, help="where the copy runs (default: a temporary directory)")
    args = p.parse_args()
    kimi = yaml.safe_load(args.kimi.read_text())
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    with tempfile.TemporaryDirectory(dir=args.work) as tmp:
        work = Path(tmp)
        prepare(args.source.resolve(), work, kimi)
        common = ["--configfile", "kimi-storage.yaml"]
        planned = subprocess.run(
            [sys.executable, "scripts/plan.py", *common, "--json"], cwd=work, env=env, capture_output=True, text=True
        )
        if planned.returncode:
            raise SystemExit(f"scripts/plan.py failed:\n{planned.stdout}{planned.stderr}")
        plan = json.loads(planned.stdout)
        snakemake = [str(Path(sys.executable).parent / "snakemake"), "--profile", "profiles/local", *common]
        ran = subprocess.run(snakemake, cwd=work, env=env, capture_output=True, text=True)
        if ran.returncode:
            raise SystemExit(f"the run failed:\n{ran.stdout[-3000:]}{ran.stderr[-3000:]}")
        run = measure(work, plan)
        after = replan_after_first_shard(work, run, env, common)
        print(json.dumps({"storage": {k: kimi["hidden_states"].get(k) for k in STORAGE_KEYS}, "export": kimi["export"],
                          "partitions": run, "after_first_shard": after}, indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
