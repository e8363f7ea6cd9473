#!/usr/bin/env python
"""How close is the preflight's disk check at each stage of a run? A finished workflow's (the demo's) real
shard and export bytes against what workflow/disk.py counts from what exists before them: nothing (a first
run: the sources' records), the prompts (their upper bound), the responses (their usage), the tokens (their
measured counts).

A scratch copy gets each stage's outputs in turn (nothing is written to DIR); per partition and in total,
the bytes counted for its shards and exports at once (the preflight's figure) over the bytes DIR's run
wrote (every file of its shards and exports), printed as JSON.

Usage: python bench/disk_basis.py --from DIR [--configfile FILE]
(DIR: a finished workflow directory with its shards kept, e.g. the repository after `make demo`).
"""

import argparse
import json
import shutil
import tempfile
from pathlib import Path

import yaml

from eagle3_datagen.config_schema import fill_defaults
from eagle3_datagen.workflow import disk
from eagle3_datagen.workflow.partitions import baseline_partitions, prompt_partition, shard_names


def written_bytes(results: Path, config: dict, partition: str) -> int:
    shards = sum(disk.existing_bytes(results / partition / "hidden" / s) for s in shard_names(config, partition))
    exports = disk.exported_formats(config, partition)
    return shards + sum(disk.existing_bytes(results / partition / "export" / f) for f in exports)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--from", dest="source", type=Path, required=True, help="a finished workflow directory")
    p.add_argument("--configfile", type=Path, help="its config (default: DIR/config.yaml)")
    args = p.parse_args()
    config = fill_defaults(yaml.safe_load((args.configfile or args.source / "config.yaml").read_text()))
    for settings in config["partitions"].values():  # sources relative to DIR
        if not Path(settings["source"]).is_absolute() and (args.source / settings["source"]).exists():
            settings["source"] = str(args.source / settings["source"])
    if not Path(config["model"]["path"]).is_absolute():
        config["model"]["path"] = str(args.source / config["model"]["path"])
    results = args.source / "results"
    partitions = sorted(config["partitions"]) + baseline_partitions(config)
    real = {p: written_bytes(results, config, p) for p in partitions}
    out = {"written": real, "stages": {}}
    with tempfile.TemporaryDirectory(prefix="disk-basis-") as scratch:
        work = Path(scratch)
        counts = {
            "first run (sources' records)": lambda p: disk.estimated_tokens(config, p),
            "prompts (upper bound)": lambda p: disk.bounded_tokens(config, p, work),
            "responses (usage)": lambda p: disk.responded_tokens(config, p, work),
            "tokens (measured)": lambda p: disk.measured_tokens(config, p, work),
        }
        copied = {"prompts (upper bound)": "prompts", "responses (usage)": "responses", "tokens (measured)": "tokens"}
        for stage, count in counts.items():
            if stage in copied:
                for partition in partitions:
                    source = results / (prompt_partition(partition) if stage.startswith("prompts") else partition)
                    target = work / source.name / copied[stage]
                    if not target.exists():
                        shutil.copytree(source / copied[stage], target)
            counted = {p: disk.partition_bytes(config, p, count(p), work).peak for p in partitions}
            out["stages"][stage] = {
                "counted": counted,
                "ratio": {p: round(counted[p] / real[p], 2) for p in partitions},
                "total_ratio": round(sum(counted.values()) / sum(real.values()), 2),
            }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
