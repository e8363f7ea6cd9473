"""The node's rates the plan and the preflight price capture with: `plan.throughput`'s, or what the smoke run
measured on the node. Torch-free: the preflight (in the Snakefile) prices capturing released shards again."""

from __future__ import annotations

from pathlib import Path

from eagle3_datagen.backends.plugins import CAPTURE
from eagle3_datagen.formats import storage
from eagle3_datagen.formats.measured_rates import RATES, read_rates


def capture_rates(config: dict, per_token: int, prefill_tokens_per_s: float | None) -> dict:
    """The capture's tokens/s: the node's forward passes (`prefill_tokens_per_s`, `plan_rates`') and its CPU
    side, the capture job's cores (`resources.jobs.hidden_states.cpus_per_task`, less one per GPU rank) at
    the bytes per core a second measured for the storage setting; the slower one bounds the stage."""
    hidden = config["hidden_states"]
    ranks = CAPTURE[hidden["backend"]].ranks(config)
    cores = max(1, config["resources"]["jobs"]["hidden_states"]["cpus_per_task"] - ranks)
    cpu = cores * storage.capture_bytes_per_core_s(hidden["dtype"], hidden["compress"], hidden["compress_level"])
    rates = {"cpu_tokens_per_s": cpu / per_token, "cpu_cores": cores}
    if prefill_tokens_per_s:
        rates["gpu_tokens_per_s"] = prefill_tokens_per_s
    rates["tokens_per_s"] = min(r for k, r in rates.items() if k.endswith("tokens_per_s"))
    rates["bound_by"] = "cpu" if rates["tokens_per_s"] == rates["cpu_tokens_per_s"] else "gpu"
    return rates


def plan_rates(config: dict, logs: str | Path = "logs") -> dict:
    """Each rate of `plan.throughput` (tokens/s) and its basis: the smoke run's measurement on the node for
    this model where there is one, else the config's (a rate neither gives is None: no node-hours)."""
    configured = config["plan"].get("throughput") or {}
    model = str(Path(config["model"]["path"]).resolve())  # as the smoke run records it
    measured = read_rates(logs, model) or {}
    rates = {}
    for key in (*RATES, "train_tokens_per_s"):
        if measured.get(key):
            rates[key] = {"tokens_per_s": measured[key], "basis": f"measured by the smoke run, {measured['time']}"}
        else:
            rates[key] = {"tokens_per_s": configured.get(key), "basis": "plan.throughput"}
    return rates
