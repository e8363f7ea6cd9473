"""Config helpers behind `rules/common.smk`, kept here so that they are importable and tested.

Each rule's `params` carry only the settings that shape its own output, so that Snakemake's
params rerun trigger invalidates exactly the partitions a config change touches.
"""

from __future__ import annotations

import json
from pathlib import Path

from eagle3_datagen.formats.checkpoint import text_config

BACKENDS = ("hf", "sglang", "openrouter")
GPU_BACKENDS = ("sglang",)
ID_BACKENDS = ("hf", "sglang")  # backends that return the generated token IDs


def shard_names(config: dict, partition: str) -> list[str]:
    return [f"{i:05d}" for i in range(config["partitions"][partition]["shards"])]


def inference_backend(config: dict, partition: str) -> str:
    return config["partitions"][partition].get("backend") or config["inference"]["backend"]


def prompt_settings(config: dict, partition: str) -> dict:
    """The prompts rule's settings. Keys at their defaults are left out, so that a config written
    before they existed keeps its params (and its finished prompts are not rescheduled)."""
    part = config["partitions"][partition]
    settings = {
        "format": part["format"],
        "system_prompt": part.get("system_prompt"),
        "max_prompts": part.get("max_prompts"),
    }
    if part.get("max_bad_record_rate"):
        settings["max_bad_record_rate"] = part["max_bad_record_rate"]
    if earlier := earlier_partitions(config, partition):
        settings["drop_shared_with"] = earlier
    return settings


def earlier_partitions(config: dict, partition: str) -> list[str]:
    """The partitions whose prompts `partition` leaves out: those before it in name order, when
    `prompts.shared_across_partitions` is `drop`; none when it is `keep` (the default)."""
    if (config.get("prompts") or {}).get("shared_across_partitions", "keep") != "drop":
        return []
    return [p for p in sorted(config["partitions"]) if p < partition]


def model_settings(config: dict) -> dict:
    model = config["model"]
    return {
        "path": model["path"],
        "trust_remote_code": model.get("trust_remote_code", False),
        "chat_template_kwargs": model.get("chat_template_kwargs") or {},
        "special_tokens": model.get("special_tokens") or {},
    }


def response_settings(config: dict, partition: str) -> dict:
    backend = inference_backend(config, partition)
    inference = config["inference"]
    return {
        "backend": backend,
        "sampling": inference["sampling"],
        backend: inference.get(backend) or {},
        "token_budget": inference.get("token_budget"),
        "model": model_settings(config),
    }


def served_by_launched_server(config: dict, partition: str) -> bool:
    """Partitions whose responses come from the SGLang server one job launches for all of them."""
    return inference_backend(config, partition) == "sglang" and bool(
        (config["inference"].get("sglang") or {}).get("launch")
    )


def token_settings(config: dict) -> dict:
    return {"tokens": config["tokens"], "model": model_settings(config)}


def hidden_settings(config: dict) -> dict:
    return {"hidden_states": config["hidden_states"], "model": model_settings(config)}


def probe_settings(config: dict, partition: str) -> dict:
    """The probe's thresholds, and whether the partition's data is greedy with exact output IDs."""
    backend = inference_backend(config, partition)
    greedy_exact = (
        backend in ID_BACKENDS
        and config["inference"]["sampling"].get("temperature", 0.0) == 0.0
        and config["tokens"].get("prefer_ids", "server") == "server"
    )
    return {
        "probe": config.get("probe") or {},
        "backend": backend,
        "greedy_exact": greedy_exact,
        "model": {"path": config["model"]["path"]},
    }


def uses_gpu(config: dict, stage: str, partition: str | None = None) -> bool:
    if stage == "responses":
        backend = inference_backend(config, partition)
        if backend in GPU_BACKENDS:
            return True
        return backend == "hf" and config["inference"].get("hf", {}).get("device", "cpu") == "cuda"
    return config["hidden_states"].get("backend", "hf") in GPU_BACKENDS or (
        config["hidden_states"].get("hf", {}).get("device", "cpu") == "cuda"
    )


def gpus_for(config: dict, stage: str, partition: str | None = None) -> int:
    """GPUs a job of `stage` asks for; only the responses stage depends on the partition."""
    return config["resources"]["gpus_per_node"] if uses_gpu(config, stage, partition) else 0


def demo_fit_partitions(config: dict) -> list[dict]:
    """What the demo model is fitted to, per partition: the Qwen3 demo learns the sources' own
    conversations; the tiny Kimi model learns the prompts as the prompts stage builds them, so a
    partition's system prompt changes it (and only it)."""
    keys = (
        ("source", "format", "system_prompt")
        if config["demo"].get("architecture") == "deepseek_v3"
        else ("source", "format")
    )
    return [{k: config["partitions"][p].get(k) for k in keys} for p in sorted(config["partitions"])]


def missing_sources(config: dict, config_files: list) -> list[str]:
    """One message per partition whose source file does not exist, naming what to fix."""
    where = ", ".join(str(f) for f in config_files)
    return [
        f"partition {name!r}: source {part['source']!r} does not exist (set in {where}; "
        f"resolved from {Path.cwd()}). Fix the path, or put the file there."
        for name, part in sorted(config["partitions"].items())
        if not Path(part["source"]).exists()
    ]


def as_json(settings: dict) -> str:
    """Canonical JSON, so equal settings always compare equal in Snakemake's params trigger."""
    return json.dumps(settings, sort_keys=True, separators=(",", ":"))


def storage_problems(config: dict) -> list[str]:
    """One message per hidden-state setting that a reader or an export could not take, naming the
    fix; checked before any job, so nothing is captured that cannot be used."""
    hidden = config["hidden_states"]
    problems = []
    formats = (config.get("export") or {}).get("formats") or []
    if "speculators" in formats and hidden.get("final", "raw") == "normed":
        problems.append(
            "hidden_states.final: normed cannot be exported to speculators: speculators 0.9.0 applies the "
            "verifier's final norm to the last slot itself and would norm it twice. Set hidden_states.final: raw "
            "(the specforge export applies the norm where SpecForge needs it), or drop speculators from export.formats."
        )
    dtype, scales = hidden["dtype"], hidden.get("scales", "token")
    if dtype.startswith("float8") and scales == "block":
        hidden_size = demo_or_model_hidden_size(config)
        block = hidden.get("scale_block", 128)
        if hidden_size is not None and hidden_size % min(block, hidden_size):
            problems.append(
                f"hidden_states.scale_block {block} does not divide the model's hidden size {hidden_size}: "
                "set a scale_block that divides it (or scales: token)."
            )
    return problems


def demo_or_model_hidden_size(config: dict) -> int | None:
    """The target's hidden size, where it is known before any job (the demo's config, or a model
    directory that already exists)."""
    if "demo" in config:
        return config["demo"].get("hidden_size")
    model_dir = Path(config["model"]["path"])
    return int(text_config(model_dir)["hidden_size"]) if (model_dir / "config.json").exists() else None
