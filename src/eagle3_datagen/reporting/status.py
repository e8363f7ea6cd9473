"""Which partitions are complete, running, stale, failed or pending, from Snakemake's own records.

`snakemake --summary` gives every output's status (`ok`, `missing`, or why it is out of date:
params, code, input or software changed); `.snakemake/incomplete/` holds a marker for each output
of a job that started and has not finished; `.snakemake/locks/` is non-empty while a Snakemake
process works in the directory. Per partition, in this order:
- running: a job of it has started and not finished, and the directory is locked;
- failed: a job of it started and never finished with no Snakemake running (killed), or an output
  is missing although its log exists (the job ran and failed);
- stale: an output exists but a change invalidated it (the reasons are listed);
- pending: outputs are missing and none of their jobs has run;
- complete: every output is up to date.
"""

from __future__ import annotations

import os
import re
from base64 import urlsafe_b64decode
from pathlib import Path

PARTITION_OF = re.compile(r"^results/(?:report/)?([^/]+?)(?:/|\.json$)")


def parse_summary(text: str) -> list[dict]:
    """Rows of `snakemake --summary`: output_file, date, rule, log-file(s), status, plan."""
    lines = [line for line in text.splitlines() if "\t" in line]
    if not lines:
        return []
    header = lines[0].split("\t")
    return [dict(zip(header, line.split("\t"), strict=False)) for line in lines[1:]]


def incomplete_outputs(workdir: str | Path) -> set[str]:
    """Outputs whose job started and did not finish (Snakemake's base64-named markers)."""
    root = Path(workdir) / ".snakemake" / "incomplete"
    outputs = set()
    for path in root.rglob("*") if root.exists() else ():
        if path.is_dir() or path.name == "migration_underway":
            continue
        # Long names are split into directories whose names start with "@".
        encoded = "".join(part.lstrip("@") for part in path.relative_to(root).parts)
        outputs.add(urlsafe_b64decode(encoded.encode()).decode())
    return outputs


def is_locked(workdir: str | Path) -> bool:
    locks = Path(workdir) / ".snakemake" / "locks"
    return locks.exists() and any(locks.iterdir())


def partition_states(
    rows: list[dict], partitions: list[str], workdir: str | Path, incomplete: set[str], locked: bool
) -> dict[str, dict]:
    by_partition: dict[str, list[dict]] = {p: [] for p in partitions}
    for row in rows:
        match = PARTITION_OF.match(row["output_file"])
        if match and match.group(1) in by_partition:
            by_partition[match.group(1)].append(row)
    states = {}
    for partition, outputs in by_partition.items():
        started = sorted(r["output_file"] for r in outputs if r["output_file"] in incomplete)
        ran_without_output = sorted(
            r["output_file"]
            for r in outputs
            if r["status"] == "missing"
            and r["output_file"] not in incomplete
            and any(log and os.path.exists(Path(workdir) / log) for log in r.get("log-file(s)", "").split(","))
        )
        changed = sorted({f"{r['rule']}: {r['status']}" for r in outputs if r["status"] not in ("ok", "missing")})
        if started and locked:
            state, detail = "running", started
        elif started or ran_without_output:
            state, detail = "failed", started or ran_without_output
        elif changed:
            state, detail = "stale", changed
        elif any(r["status"] == "missing" for r in outputs) or not outputs:
            state, detail = "pending", sorted(r["output_file"] for r in outputs if r["status"] == "missing")
        else:
            state, detail = "complete", []
        states[partition] = {"state": state, "detail": detail}
    return states


def format_states(states: dict[str, dict]) -> str:
    lines = []
    for partition, info in states.items():
        lines.append(f"{partition:<24} {info['state']}")
        lines.extend(f"    {item}" for item in info["detail"][:8])
        if len(info["detail"]) > 8:
            lines.append(f"    ... {len(info['detail']) - 8} more")
    return "\n".join(lines)
