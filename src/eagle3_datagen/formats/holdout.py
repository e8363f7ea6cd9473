"""The evaluation's held-out prompts (`results/{partition}/evaluate/holdout.json`): chosen by prompt id,
left out of every export of the partition (and of its baseline's, which shares its prompt ids), their
samples the evaluation set.

The choice depends on the ids and the seed alone: the `count` ids with the smallest sha256 of
`seed:id`, so a rerun, another shard count or another response backend holds out the same prompts.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable

from eagle3_datagen.formats.files import InputError, read_json, write_json


def choose_holdout(prompt_ids: Iterable[str], count: int, seed: int) -> list[str]:
    """The `count` ids (all, if fewer) with the smallest sha256(`seed:id`), in that order."""
    return sorted(set(prompt_ids), key=lambda i: hashlib.sha256(f"{seed}:{i}".encode()).hexdigest())[:count]


def write_holdout(path: str | os.PathLike, ids: list[str], prompts: int, count: int, seed: int) -> None:
    write_json(path, {"ids": ids, "held_out": len(ids), "prompts": prompts, "holdout": count, "seed": seed})


def read_holdout(path: str | os.PathLike) -> list[str]:
    """The held-out prompt ids of a holdout file."""
    record = read_json(path)
    if not isinstance(record, dict) or not isinstance(record.get("ids"), list):
        raise InputError(path, None, "not a holdout file (no `ids` list)", "rerun the evaluate_holdout rule")
    return record["ids"]
