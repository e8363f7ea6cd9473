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


OUTPUT = "output"  # shapes the stage's output: in the rule's params, so a change reruns the stage
RUN = "run"  # governs only how the job runs: read at run time, a change reschedules nothing

# Every config key's kind, by its path in the schema (`*`: any partition's name). One table, so
# that a key the schema gains without an entry here fails tests/test_settings.py.
# Ambiguous keys, decided: what changes float bits but not meaning (tensor-parallel size, batch
# size, device, packing of prefill batches) is RUN, and the job records it in its provenance.
KINDS: dict[str, str] = {
    **dict.fromkeys(
        [
            "model.path",
            "model.trust_remote_code",
            "model.chat_template_kwargs",
            "model.special_tokens.end_of_turn",
            "model.special_tokens.think_start",
            "model.special_tokens.think_end",
            "model.special_tokens.expected_ids",
            "partitions.*.source",
            "partitions.*.format",
            "partitions.*.shards",
            "partitions.*.backend",
            "partitions.*.max_prompts",
            "partitions.*.system_prompt",
            # a threshold decides whether the shard exists, as the probe's thresholds do
            "partitions.*.max_bad_record_rate",
            "prompts.shared_across_partitions",
            "inference.backend",
            "inference.sampling.max_new_tokens",
            "inference.sampling.temperature",
            "inference.sampling.top_p",
            "inference.sampling.top_k",
            "inference.sampling.seed",
            "inference.hf.dtype",
            "inference.sglang.served_model",
            # the server's flags that change what it returns (parsers, quantization, context length)
            "inference.sglang.launch.args",
            "inference.sglang.tiers.short.max_tokens",
            "inference.sglang.tiers.short.max_prompt_tokens",
            "inference.sglang.tiers.long.max_tokens",
            "inference.openrouter.base_url",
            "inference.openrouter.model",
            "inference.openrouter.max_tokens",
            "inference.openrouter.reasoning",
            "inference.openrouter.provider",
            "tokens.thinking",
            "tokens.prefer_ids",
            "tokens.keep_truncated",
            "tokens.max_length",
            "tokens.length_policy",
            "tokens.max_semantic_mismatch_rate",
            "tokens.audit_examples",
            "hidden_states.backend",
            "hidden_states.aux_layers",
            "hidden_states.final",
            "hidden_states.dtype",
            "hidden_states.scales",
            "hidden_states.scale_block",
            "hidden_states.reference_positions",
            "hidden_states.shard_bytes",
            "hidden_states.compress",
            "hidden_states.compress_level",
            "hidden_states.max_nonfinite_fraction",
            "hidden_states.hf.dtype",
            "hidden_states.sglang.dtype",
            "hidden_states.sglang.server_args",
            "export.formats",
            "vocab_mapping.draft_vocab_size",
            "probe.max_positions",
            "probe.min_greedy_agreement",
            "probe.first_positions",
            "probe.min_first_agreement",
            "probe.min_mean_logprob",
            "probe.report_positions",
            "probe.seed",
            "probe.max_agreement_drop",
        ],
        OUTPUT,
    ),
    **dict.fromkeys(
        [
            "inference.hf.batch_size",
            "inference.hf.device",
            # a stop at the budget keeps the journal; a raised budget continues from it
            "inference.token_budget",
            "inference.sglang.url",
            "inference.sglang.request_timeout",
            "inference.sglang.health_timeout",
            "inference.sglang.launch.command",
            "inference.sglang.launch.run_args",
            "inference.sglang.launch.health_timeout",
            "inference.sglang.launch.stop_timeout",
            "inference.sglang.launch.idle_timeout",
            "inference.sglang.launch.hang_timeout",
            "inference.sglang.launch.max_service_restarts",
            "inference.sglang.tiers.short.concurrency",
            "inference.sglang.tiers.long.concurrency",
            "inference.sglang.retry.max_attempts",
            "inference.sglang.retry.initial_backoff",
            "inference.sglang.retry.max_backoff",
            "inference.sglang.retry.max_retry_after",
            "inference.openrouter.api_key_env",
            "inference.openrouter.concurrency",
            "inference.openrouter.request_timeout",
            "inference.openrouter.max_cost_usd",
            "inference.openrouter.price_per_million.prompt",
            "inference.openrouter.price_per_million.completion",
            "inference.openrouter.retry.max_attempts",
            "inference.openrouter.retry.initial_backoff",
            "inference.openrouter.retry.max_backoff",
            "inference.openrouter.retry.max_retry_after",
            "hidden_states.max_batch_tokens",
            "hidden_states.hf.device",
            "hidden_states.sglang.device",
            "hidden_states.sglang.mem_fraction_static",
            "hidden_states.runner.idle_timeout",
            "hidden_states.runner.load_timeout",
            "probe.device",
            "plan.throughput.generate_tokens_per_s",
            "plan.throughput.prefill_tokens_per_s",
            "plan.model.num_layers",
            "plan.model.hidden_size",
            "plan.load_seconds.generation_server",
            "plan.load_seconds.capture_runner",
            # the tensor-parallel size of SGLang's server and capture runner
            "resources.gpus_per_node",
            "resources.jobs.hidden_states.mem_mb",
            "resources.jobs.hidden_states.cpus_per_task",
            "resources.jobs.hidden_states.runtime",
            "resources.jobs.responses_sglang_server.mem_mb",
            "resources.jobs.responses_sglang_server.cpus_per_task",
            "resources.jobs.responses_sglang_server.runtime",
        ],
        RUN,
    ),
}
# The demo model is an output of its own rule: every setting of it shapes it.
DEMO_PREFIX = "demo."


def kind_of(path: str) -> str:
    """The kind of the config key at dotted `path` (a partition's name in place of `*`)."""
    parts = path.split(".")
    if parts[0] == "partitions" and len(parts) > 2:
        parts[1] = "*"
    key = ".".join(parts)
    if key.startswith(DEMO_PREFIX):
        return OUTPUT
    if key not in KINDS:
        raise KeyError(f"config key {key!r} is not classified in eagle3_datagen.workflow.settings.KINDS")
    return KINDS[key]


def split(section: dict | None, path: str) -> tuple[dict, dict]:
    """`section` (the config at dotted `path`) as its output-shaping and its run-only settings."""
    output, run = {}, {}
    for key, value in (section or {}).items():
        sub = f"{path}.{key}"
        if isinstance(value, dict) and not _is_leaf(sub):
            out_part, run_part = split(value, sub)
            if out_part:
                output[key] = out_part
            if run_part:
                run[key] = run_part
        elif kind_of(sub) == OUTPUT:
            output[key] = value
        else:
            run[key] = value
    return output, run


def _is_leaf(path: str) -> bool:
    try:
        kind_of(path)
    except KeyError:
        return False
    return True


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
    """What shapes the partition's responses: its backend, sampling, that backend's output settings."""
    backend = inference_backend(config, partition)
    inference = config["inference"]
    return {
        "backend": backend,
        "sampling": inference["sampling"],
        backend: split(inference.get(backend), f"inference.{backend}")[0],
        "model": model_settings(config),
    }


def response_run_settings(config: dict) -> dict:
    """What governs a responses job, for every backend (a job reads its own backend's), and the GPUs a
    launched server's job step asks for under SLURM."""
    inference = config["inference"]
    run = {b: split(inference.get(b), f"inference.{b}")[1] for b in BACKENDS}
    return {"token_budget": inference.get("token_budget"), "gpus": config["resources"]["gpus_per_node"], **run}


def served_by_launched_server(config: dict, partition: str) -> bool:
    """Partitions whose responses come from the SGLang server the workflow launches for them."""
    return inference_backend(config, partition) == "sglang" and bool(
        (config["inference"].get("sglang") or {}).get("launch")
    )


def token_settings(config: dict) -> dict:
    return {"tokens": split(config["tokens"], "tokens")[0], "model": model_settings(config)}


def hidden_settings(config: dict) -> dict:
    """What shapes hidden states; of the backends' own sections, only the configured backend's."""
    hidden = dict(config["hidden_states"])
    backend = hidden.get("backend", "hf")
    for other in ("hf", "sglang"):
        if other != backend:
            hidden.pop(other, None)
    return {"hidden_states": split(hidden, "hidden_states")[0], "model": model_settings(config)}


def hidden_run_settings(config: dict) -> dict:
    """The capture's run-only settings and the GPUs its runner takes: SGLang's tensor-parallel size."""
    return {
        "hidden_states": split(config["hidden_states"], "hidden_states")[1],
        "tensor_parallel": gpus_for(config, "hidden_states") or 1,
    }


def probe_settings(config: dict, partition: str) -> dict:
    """The probe's thresholds, and whether the partition's data is greedy with exact output IDs."""
    backend = inference_backend(config, partition)
    greedy_exact = (
        backend in ID_BACKENDS
        and config["inference"]["sampling"].get("temperature", 0.0) == 0.0
        and config["tokens"].get("prefer_ids", "server") == "server"
    )
    return {
        "probe": split(config.get("probe"), "probe")[0],
        "backend": backend,
        "greedy_exact": greedy_exact,
        "model": {"path": config["model"]["path"]},
    }


def probe_run_settings(config: dict) -> dict:
    return {"probe": split(config.get("probe"), "probe")[1]}


RUN_SETTINGS_ENV = "EAGLE3_DATAGEN_RUN_SETTINGS"


def run_settings(config: dict) -> dict:
    """Every stage's run-only settings, by the name its job asks for them under."""
    return {
        "responses": response_run_settings(config),
        "hidden_states": hidden_run_settings(config),
        "probe": probe_run_settings(config),
    }


def merged(settings: dict, run: dict) -> dict:
    """A job's settings: the rule's output-shaping ones with the run-only ones read at run time."""
    out = dict(settings)
    for key, value in run.items():
        out[key] = merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


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


# What the GPU stages' jobs start on their node (their node service) and so launch themselves, a process
# per GPU: the slurm plugin's name for such a job's launcher.
LAUNCHERS = {"hidden_states": "torchrun", "responses_sglang_server": "sglang.launch_server"}


def cluster_job(config: dict, rule: str, gpus: int) -> dict:
    """What a heavy rule's cluster job asks for: `resources.jobs.<rule>` (memory, CPUs and minutes of the
    job). A job on more than one GPU of its node is one that launches its own processes, one task per GPU
    (the plugin's `mpi` jobs): the slurm-jobstep executor runs such a job in its allocation's batch step
    instead of a job step of its own, so the node service it starts outlives it and serves the
    allocation's next shard jobs (SLURM kills what a job step leaves behind when the step ends). Its CPUs
    are asked for per task. Local runs ignore all of these."""
    job = dict(config["resources"]["jobs"][rule])
    if gpus > 1:
        job.update(mpi=LAUNCHERS[rule], tasks_per_node=gpus, cpus_per_task=max(1, job["cpus_per_task"] // gpus))
    return job


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


# The only folder the demo may build its model in: Snakemake removes a directory() output before the job
# that rebuilds it, so a demo pointed at a user's own model directory would delete it.
DEMO_MODEL_ROOT = "results"


def demo_model_problems(config: dict) -> list[str]:
    """A config with a `demo:` block builds its model at `model.path`: refused unless that path lies under
    results/, the workflow's own folder, so that no run can replace a model the workflow did not make."""
    if "demo" not in config:
        return []
    path = config["model"]["path"]
    parts = Path(path).parts
    if len(parts) > 1 and parts[0] == DEMO_MODEL_ROOT and ".." not in parts:
        return []
    return [
        f"model.path {path!r} with a demo: block: the demo builds (and rebuilds, deleting the old one) its tiny "
        f"model at model.path, so it must lie under {DEMO_MODEL_ROOT}/ (e.g. {DEMO_MODEL_ROOT}/demo/model). To run "
        "your own model, delete the demo: block from your config and keep model.path; to run the demo, set "
        f"model.path: {DEMO_MODEL_ROOT}/demo/model."
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
