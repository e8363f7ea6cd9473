#!/usr/bin/env python
"""Time a dry-run of a generated config with many partitions x shards (DAG building cost).

Usage: python bench/dryrun_scale.py [--partitions 100] [--shards 16] [--repeats 3]
Run from the repository root with the project's venv on PATH.
"""

import argparse
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--partitions", type=int, default=100)
    p.add_argument("--shards", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for name in ("Snakefile", "rules", "scripts", "report", "profiles"):
            src = REPO / name
            (shutil.copytree if src.is_dir() else shutil.copy2)(src, work / name)
        config = yaml.safe_load((REPO / "config" / "kimi-k2.5-openrouter.yaml").read_text())
        (work / "data").mkdir()
        config["partitions"] = {}
        for i in range(args.partitions):
            source = work / "data" / f"p{i}.jsonl"
            source.write_text("")
            config["partitions"][f"P{i:03d}"] = {"source": str(source), "format": "auto", "shards": args.shards}
        (work / "big.yaml").write_text(yaml.safe_dump(config))
        times, jobs = [], None
        for _ in range(args.repeats):
            start = time.perf_counter()
            proc = subprocess.run(
                ["snakemake", "-n", "--quiet", "rules", "--configfile", "big.yaml", "--cores", "1"],
                cwd=work,
                capture_output=True,
                text=True,
                check=True,
            )
            out = proc.stdout + proc.stderr
            times.append(time.perf_counter() - start)
            jobs = next(line.split()[-1] for line in out.splitlines() if line.startswith("total"))
        start = time.perf_counter()
        subprocess.run(["snakemake", "--version"], cwd=work, capture_output=True, check=True)
        startup = time.perf_counter() - start
    print(f"partitions={args.partitions} shards={args.shards} jobs={jobs}")
    print(f"dry-run seconds: median {statistics.median(times):.2f} (runs: {', '.join(f'{t:.2f}' for t in times)})")
    print(f"snakemake --version (interpreter + import) seconds: {startup:.2f}")


if __name__ == "__main__":
    main()
