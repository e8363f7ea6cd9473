"""The rules' settings: each setting's kind (`x-kind`), and per rule the settings that shape its output
(its `params`) and those that only govern how its jobs run (read at run time).

Each rule's `params` carry only the settings that shape its own output, so that Snakemake's
params rerun trigger invalidates exactly the partitions a config change touches. The partitions are in
`partitions`, where jobs run in `placement`, the checks before any job in `config_checks`.
"""

from __future__ import annotations

import json

from eagle3_datagen.backends.plugins import CAPTURE, DATASET, GENERATION
from eagle3_datagen.config_schema import KINDS, OUTPUT, RUN, kind_of, split  # noqa: F401  (the rules read them here)
from eagle3_datagen.workflow.partitions import (
    earlier_partitions,
    inference_backend,
    partition_config,
    source_is_input,
)
from eagle3_datagen.workflow.placement import gpus_for

# Partition keys that are not the prompts rule's params: the responses' backend (response_settings), and the
# shard count, which the rule's outputs' names carry.
NOT_PROMPT_KEYS = ("backend", "shards")
PARTITION_KEYS = [path.removeprefix("partitions.*.") for path in KINDS if path.startswith("partitions.*.")]


def prompt_settings(config: dict, partition: str, commit: str | None = None) -> dict:
    """The prompts rule's settings: the partition's output-shaping keys (a key not set: None), as `split`
    sorts every section's.

    A glob's, a directory's or a hub dataset's `source` is here, as no single input file names it (a file
    source is the rule's input: None here); a hub dataset's `commit` (its revision resolved from the cache,
    source_commits) too, so a new one reruns the partition.
    """
    part = config["partitions"][partition]
    keys = [key for key in PARTITION_KEYS if key not in NOT_PROMPT_KEYS]
    own = split({key: part.get(key) for key in keys}, f"partitions.{partition}")[0]
    return {
        **own,
        "source": None if source_is_input(part["source"]) else part["source"],
        "commit": commit,
        "drop_shared_with": earlier_partitions(config, partition),
    }


def model_settings(config: dict) -> dict:
    return split(config["model"], "model")[0]


# Where a one-pass server writes each request's states before its job stages them beside the responses:
# on the results' filesystem, so that staging is a rename.
ONE_PASS_STORAGE = "results/.one_pass"


def one_pass_states(config: dict, partition: str) -> str | None:
    """Where the partition's responses jobs stage its states in one-pass mode, as a `{shard}` pattern; None
    where its capture jobs capture them."""
    if not (inference_backend(config, partition) == "vllm" and config["hidden_states"]["one_pass"]):
        return None
    return f"results/{partition}/responses/{{shard}}.states"


def response_settings(config: dict, partition: str) -> dict:
    """What shapes the partition's responses: its backend, sampling, that backend's output settings; for
    the `dataset` backend, the source its prompts were read from and how (no sampling: nothing is generated)."""
    backend = inference_backend(config, partition)
    if backend == DATASET:
        return {"backend": backend, DATASET: dataset_settings(config, partition), "model": model_settings(config)}
    inference = config["inference"]
    own = split(inference[backend], f"inference.{backend}")[0]
    own.pop("sampling", None)  # merged into `sampling`
    if one_pass_states(config, partition) is not None:
        own["one_pass"] = {"aux_layers": config["hidden_states"]["aux_layers"], "storage": ONE_PASS_STORAGE}
    sampling = sampling_for(config, backend)
    return {"backend": backend, "sampling": sampling, backend: own, "model": model_settings(config)}


def sampling_for(config: dict, backend: str) -> dict:
    """The sampling a backend generates with: `inference.sampling`, with the keys its own `sampling` sets
    over it (e.g. an API that takes only temperature 1 beside a greedy local server)."""
    return {**config["inference"]["sampling"], **((config["inference"].get(backend) or {}).get("sampling") or {})}


def dataset_settings(config: dict, partition: str) -> dict:
    """Where the `dataset` backend reads the records of a partition's prompts, and how they were parsed."""
    part = partition_config(config, partition)
    settings = {"source": part["source"], "format": part["format"], "system_prompt": part.get("system_prompt")}
    settings.update({k: part[k] for k in ("subset", "split", "revision") if part.get(k) is not None})
    return settings


def response_run_settings(config: dict) -> dict:
    """What governs a responses job, for every backend (a job reads its own backend's), the GPUs a
    launched server's job step asks for under SLURM, and how it waits for their memory."""
    inference = config["inference"]
    # a section without defaults (openrouter's) is absent where no partition uses it
    run = {b.name: split(b.settings(config), b.section)[1] for b in GENERATION.values() if b.section}
    return {
        "token_budget": inference.get("token_budget"),  # absent: no budget
        "max_failed_rate": inference["max_failed_rate"],
        "ledger_dir": inference["ledger_dir"],
        "gpus": config["resources"]["gpus_per_node"],
        "handover": config["resources"]["handover"],
        **run,
    }


def token_settings(config: dict) -> dict:
    return {"tokens": split(config["tokens"], "tokens")[0], "model": model_settings(config)}


def hidden_settings(config: dict) -> dict:
    """What shapes hidden states; of the backends' own sections, only the configured backend's."""
    hidden = dict(config["hidden_states"])
    backend = hidden["backend"]
    for other in CAPTURE:
        if other != backend:
            hidden.pop(other, None)
    return {"hidden_states": split(hidden, "hidden_states")[0], "model": model_settings(config)}


def hidden_run_settings(config: dict) -> dict:
    """The capture's run-only settings, the GPUs its runner takes (SGLang's tensor-parallel size), how it
    waits for their memory, and the stated quota its disk check counts."""
    return {
        "hidden_states": split(config["hidden_states"], "hidden_states")[1],
        "tensor_parallel": gpus_for(config, "hidden_states") or 1,
        "handover": config["resources"]["handover"],
        "disk_quota_bytes": config["resources"]["disk_quota_bytes"],
    }


def probe_settings(config: dict, partition: str) -> dict:
    """The probe's thresholds, and whether the partition's data is greedy with exact output IDs."""
    backend = inference_backend(config, partition)
    greedy_exact = (
        GENERATION[backend].token_ids
        and sampling_for(config, backend)["temperature"] == 0.0
        and config["tokens"]["prefer_ids"] == "server"
    )
    return {
        "probe": split(config["probe"], "probe")[0],
        "backend": backend,
        "greedy_exact": greedy_exact,
        "model": {"path": config["model"]["path"]},
    }


def export_settings(config: dict, fmt: str) -> dict:
    """What shapes an export of `fmt` beyond its inputs: its own section, `export.<fmt>` (SpecForge's rows'
    compression; speculators has none: nothing)."""
    own = config["export"].get(fmt)
    return {fmt: split(own, f"export.{fmt}")[0]} if own is not None else {}


def probe_run_settings(config: dict) -> dict:
    return {"probe": split(config["probe"], "probe")[1]}


RUN_SETTINGS_ENV = "EAGLE3_DATAGEN_RUN_SETTINGS"


def run_settings(config: dict) -> dict:
    """Every stage's run-only settings, by the name its job asks for them under."""
    return {
        "responses": response_run_settings(config),
        "hidden_states": hidden_run_settings(config),
        "probe": probe_run_settings(config),
        "evaluate": split(config.get("evaluate"), "evaluate")[1],
    }


def merged(settings: dict, run: dict) -> dict:
    """A job's settings: the rule's output-shaping ones with the run-only ones read at run time."""
    out = dict(settings)
    for key, value in run.items():
        out[key] = merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def demo_fit_partitions(config: dict) -> list[dict]:
    """What the demo model is fitted to, per partition: the Qwen3 demo learns the sources' own
    conversations; a target built from a tokenizer folder (the tiny Kimi, the families' tiny targets)
    learns the prompts as the prompts stage builds them, so a partition's system prompt changes it (and
    only it)."""
    keys = ("source", "format", "system_prompt") if "tokenizer" in config["demo"] else ("source", "format")
    return [{k: config["partitions"][p].get(k) for k in keys} for p in sorted(config["partitions"])]


# The model settings a target built from a tokenizer folder renders its fitting prompts with, as the run does.
DEMO_CHAT_KEYS = ("chat_template_kwargs", "chat_template_date", "family")


def demo_settings(config: dict) -> dict:
    """The demo model builder's settings: the `demo` section, and for a target built from a tokenizer folder
    the model's chat settings (`chat`), so that it is fitted to the prompts the run renders."""
    if "tokenizer" not in config["demo"]:
        return config["demo"]
    return {**config["demo"], "chat": {key: config["model"][key] for key in DEMO_CHAT_KEYS}}


def as_json(settings: dict) -> str:
    """Canonical JSON, so equal settings always compare equal in Snakemake's params trigger."""
    return json.dumps(settings, sort_keys=True, separators=(",", ":"))


# The interpreter that runs scripts/evaluate.py (SpecForge's venv), set by rules/common.smk for every
# process that parses the workflow: a run-only setting, so it reaches the jobs' shell through the
# environment rather than their command's text (a changed command reruns a job).
SPECFORGE_PYTHON_ENV = "EAGLE3_DATAGEN_SPECFORGE_PYTHON"


def evaluate_settings(config: dict) -> dict:
    """What shapes one draft's evaluation (every `evaluate` key but the interpreter and the curve's
    `fractions`: each fraction is a job of its own, so adding one reruns no other); {} without the stage."""
    settings = split(config.get("evaluate"), "evaluate")[0]
    settings.pop("fractions", None)
    return settings


def curve_point_settings(config: dict) -> dict:
    """What shapes a point of the data curve: `evaluate_settings` but the quick fail's
    `min_acceptance_length`, which no point applies (a small fraction's draft may well fall below it), so
    changing it reruns the whole's drafts alone."""
    settings = evaluate_settings(config)
    settings.pop("min_acceptance_length", None)
    return settings


def curve_fractions(config: dict) -> list[float]:
    """The data curve's fractions below 1 (`evaluate.fractions`; 1 is the evaluate job's draft), each once,
    ascending; [] without the stage."""
    return sorted({f for f in (config.get("evaluate") or {}).get("fractions", []) if f < 1})
