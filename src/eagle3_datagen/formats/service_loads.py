"""The node services' load records: one JSON line per model load (service, model, seconds, node, time).

A service's supervisor appends one once its model is ready; the plan (`reporting/plan.py`) reads them
for the seconds a load takes, so no log line's wording is part of that contract. Each allocation
writes a file of its own beside the service's log (`logs/<service>/loads.jsonl`, under SLURM
`loads.slurm-<job>.jsonl`): nodes do not append to one file on a shared filesystem.
"""

from __future__ import annotations

import json
import os
from datetime import UTC, datetime
from pathlib import Path

from eagle3_datagen.formats.files import iter_jsonl

NAME = "loads.jsonl"


def append_load(path: str | os.PathLike, service: str, model: str, seconds: float, node: str) -> None:
    """Append one load record to `path`, in one write (a line is never interleaved with another)."""
    record = {
        "service": service,
        "model": model,
        "seconds": round(seconds, 1),
        "node": node,
        "time": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    descriptor = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(descriptor, (json.dumps(record) + "\n").encode())
    finally:
        os.close(descriptor)


def read_loads(logs: str | os.PathLike) -> list[dict]:
    """Every load record under `logs` (each service's directory, each allocation's file)."""
    stem, suffix = NAME.split(".")
    return [record for path in sorted(Path(logs).glob(f"*/{stem}*.{suffix}")) for _, record in iter_jsonl(path)]
