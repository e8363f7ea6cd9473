"""A node's measured rates, the smoke run's (`scripts/smoke.py`): `logs/smoke/rates.json`, one JSON object
with the model they were measured on (its resolved path, as the load records name it), the time, and each
rate in tokens/s (`generate_tokens_per_s`: completion tokens of the generation backend; `prefill_tokens_per_s`:
tokens captured by the hidden-state stage), named as `plan.throughput` names them. The plan reads them in
place of `plan.throughput` for the same model; the smoke run's model loads go beside them
(`logs/smoke/loads.jsonl`, `formats/service_loads.py`), where the plan reads loads.
"""

from __future__ import annotations

import os
from pathlib import Path

from eagle3_datagen.formats.files import read_json, write_json

NAME = "smoke/rates.json"
RATES = ("generate_tokens_per_s", "prefill_tokens_per_s")


def write_rates(logs: str | os.PathLike, record: dict) -> Path:
    path = Path(logs) / NAME
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json(path, record)
    return path


def read_rates(logs: str | os.PathLike, model: str) -> dict | None:
    """The measured rates of `model` (a resolved path), or None where none were measured for it."""
    path = Path(logs) / NAME
    if not path.exists():
        return None
    record = read_json(path)
    return record if record.get("model") == model else None
