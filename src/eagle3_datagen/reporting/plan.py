"""What a run would cost, before it runs: prompts, tokens, dollars, GPU hours and disk.

The partitions counted are the ones Snakemake's dry-run would regenerate (their responses or
hidden-state jobs are scheduled), so the plan agrees with `snakemake -n`. Prompt tokens are
counted by rendering each prompt with the model's own chat template; completion tokens are
estimated from the configured max tokens (an upper bound) or, when earlier response shards
exist, from their observed completion tokens per turn. No model is loaded or called.

It also counts how often each big model loads in the planned run: the generation server once per
run on the node when any scheduled shard needs it (the shard jobs share it), the capture runner once
per scheduled hidden-state job, each at `plan.load_seconds` or what a first run's logs measured.
"""

from __future__ import annotations

import re
import shutil
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path

from eagle3_datagen.chat.template import load_tokenizer, render_ids
from eagle3_datagen.formats.checkpoint import text_config
from eagle3_datagen.formats.files import iter_jsonl, read_json
from eagle3_datagen.formats.hidden_codec import Codec
from eagle3_datagen.formats.hidden_shard import resolve_aux_layers
from eagle3_datagen.workflow.settings import inference_backend, served_by_launched_server, shard_names


def scheduled_jobs(dry_run_output: str) -> list[tuple[str, str | None]]:
    """(rule, partition or None) of every job in a dry-run's listing (`snakemake -n`)."""
    jobs = []
    for block in dry_run_output.split("\nrule ")[1:]:
        match = re.search(r"wildcards: partition=([\w.-]+)", block)
        jobs.append((block.split(":", 1)[0].strip(), match.group(1) if match else None))
    return jobs


RESPONSE_RULES = ("responses", "responses_sglang_server")


def scheduled_partitions(dry_run_output: str, rules: tuple[str, ...] = (*RESPONSE_RULES, "hidden_states")) -> set[str]:
    """Partitions with a job of `rules` in a dry-run's listing (`snakemake -n`)."""
    return {p for rule, p in scheduled_jobs(dry_run_output) if rule in rules and p}


DEFAULT_LOAD_SECONDS = {"generation_server": 600.0, "capture_runner": 600.0}
_STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) ")


def _stamp(line: str) -> datetime | None:
    match = _STAMP.match(line)
    return datetime.strptime(f"{match[1]}.{match[2]}", "%Y-%m-%d %H:%M:%S.%f") if match else None


def measured_server_loads(server_log: Path) -> list[float]:
    """Seconds from each start of the generation server to its first healthy answer, from its log."""
    loads, started = [], None
    for line in server_log.read_text(errors="replace").splitlines() if server_log.exists() else []:
        if "starting the SGLang server" in line:
            started = _stamp(line)
        elif "SGLang server healthy" in line and started and (at := _stamp(line)):
            loads.append((at - started).total_seconds())
            started = None
    return loads


def plan_loads(config: dict, jobs: list[tuple[str, str | None]], logs: str | Path = "logs") -> dict:
    """Per model: how many times the planned run loads it, seconds per load (and their basis), hours."""
    served = {p for p in config["partitions"] if served_by_launched_server(config, p)}
    counts = {
        # the shard jobs on the node share one server; under SLURM, one per allocation (README)
        "generation_server": int(any(rule in RESPONSE_RULES and p in served for rule, p in jobs)),
        # every hidden-state job starts its own runner and loads the model
        "capture_runner": sum(rule == "hidden_states" for rule, _ in jobs),
    }
    configured = {**DEFAULT_LOAD_SECONDS, **((config.get("plan") or {}).get("load_seconds") or {})}
    measured = {"generation_server": measured_server_loads(Path(logs) / "sglang_server" / "server.log")}
    loads = {}
    for model, count in counts.items():
        seen = measured.get(model)
        seconds = sum(seen) / len(seen) if seen else configured[model]
        basis = f"measured, mean of {len(seen)} in logs/" if seen else "plan.load_seconds"
        loads[model] = {"loads": count, "seconds_each": seconds, "basis": basis, "hours": count * seconds / 3600}
    return loads


@dataclass
class PartitionPlan:
    partition: str
    backend: str
    prompts: int
    user_turns: int
    prompt_tokens: int
    completion_tokens: int
    completion_basis: str
    cost_usd: float | None
    generation_gpu_hours: float | None
    hidden_gpu_hours: float | None
    hidden_bytes: int
    hidden_basis: str


def _model_shape(config: dict) -> tuple[int, int]:
    """(layers, hidden size) from the model directory's config.json, else from `plan.model`."""
    path = Path(config["model"]["path"]) / "config.json"
    if path.exists():
        model = text_config(config["model"]["path"])
        return model["num_hidden_layers"], model["hidden_size"]
    shape = (config.get("plan") or {}).get("model") or {}
    if not shape:
        raise FileNotFoundError(f"{path} is missing: give plan.model.num_layers and plan.model.hidden_size instead")
    return shape["num_layers"], shape["hidden_size"]


def _observed_completion_per_turn(partition: str, results: Path) -> float | None:
    turns = tokens = 0
    for path in sorted((results / partition / "responses").glob("*.stats.json")):
        stats = read_json(path)
        turns += stats.get("assistant_turns", 0)
        tokens += stats.get("usage", {}).get("completion_tokens", 0)
    return tokens / turns if turns else None


# Bytes on disk over bytes before compression when no finished shard shows it: BENCHMARKS.md
# ("Hidden-state storage"), the tiny DeepseekV3's states (no shared prompt prefixes, the least
# compressible of those measured), so an estimate for a large model until its first shard is done.
DEFAULT_RATIOS = {"none": 1.0, "zstd": 0.78, "zstd_planes": 0.70}
DEFAULT_FP8_ZSTD_RATIO = 0.80


def compression_ratio(codec: Codec, results: Path) -> tuple[float, str]:
    """On-disk over raw bytes of the finished shards stored like `codec`, else a default."""
    on_disk = raw = 0
    for path in results.glob("*/hidden/*/index.json"):
        index = read_json(path)
        stored = Codec.from_index(index)
        if (stored.dtype, stored.compress) == (codec.dtype, codec.compress) and index.get("raw_bytes"):
            on_disk += index["bytes"]
            raw += index["raw_bytes"]
    if raw:
        return on_disk / raw, "observed on finished shards"
    if codec.fp8 and codec.compressed:
        return DEFAULT_FP8_ZSTD_RATIO, "default"
    return DEFAULT_RATIOS[codec.compress], "default"


def plan_partition(config: dict, partition: str, tokenizer, results: Path) -> PartitionPlan:
    backend = inference_backend(config, partition)
    inference = config["inference"]
    max_tokens = (inference.get(backend) or {}).get("max_tokens") or inference["sampling"]["max_new_tokens"]
    template_kwargs = config["model"].get("chat_template_kwargs") or {}
    prompts = user_turns = prompt_tokens = 0
    for shard in shard_names(config, partition):
        for _, prompt in iter_jsonl(results / partition / "prompts" / f"{shard}.jsonl.zst"):
            prompts += 1
            user_turns += sum(m["role"] == "user" for m in prompt["messages"])
            prompt_tokens += len(render_ids(tokenizer, prompt["messages"], True, template_kwargs))
    observed = _observed_completion_per_turn(partition, results)
    per_turn = observed if observed is not None else max_tokens
    completion = round(user_turns * per_turn)
    basis = f"observed {observed:.0f} per turn" if observed is not None else f"max tokens {max_tokens} per turn"
    plan = config.get("plan") or {}
    prices = (inference.get("openrouter") or {}).get("price_per_million") if backend == "openrouter" else None
    cost = prompt_tokens / 1e6 * prices["prompt"] + completion / 1e6 * prices["completion"] if prices else None
    throughput = plan.get("throughput") or {}
    generate_rate = throughput.get("generate_tokens_per_s")
    prefill_rate = throughput.get("prefill_tokens_per_s")
    layers, hidden = _model_shape(config)
    settings = config["hidden_states"]
    aux = resolve_aux_layers(layers, settings["aux_layers"])
    codec = Codec.from_settings(settings)
    per_token = codec.bytes_per_token(len(aux), hidden)
    ratio, ratio_basis = compression_ratio(codec, results)
    total_tokens = prompt_tokens + completion
    return PartitionPlan(
        partition=partition,
        backend=backend,
        prompts=prompts,
        user_turns=user_turns,
        prompt_tokens=prompt_tokens,
        completion_tokens=completion,
        completion_basis=basis,
        cost_usd=cost,
        generation_gpu_hours=completion / generate_rate / 3600 if generate_rate and backend != "openrouter" else None,
        hidden_gpu_hours=total_tokens / prefill_rate / 3600 if prefill_rate else None,
        hidden_bytes=round(total_tokens * per_token * ratio),
        hidden_basis=f"{settings['dtype']}, {per_token} B/token x {ratio:.3f} ({ratio_basis})",
    )


def make_plan(
    config: dict,
    partitions: list[str],
    results: str | Path = "results",
    jobs: list[tuple[str, str | None]] | None = None,
    logs: str | Path = "logs",
) -> dict:
    """`jobs`: the dry-run's (rule, partition), to count model loads (none counted without them)."""
    results = Path(results)
    tokenizer = load_tokenizer(config["model"]["path"], config["model"].get("trust_remote_code", False))
    rows = [plan_partition(config, p, tokenizer, results) for p in sorted(partitions)]
    total = {
        key: sum(getattr(r, key) for r in rows)
        for key in ("prompts", "user_turns", "prompt_tokens", "completion_tokens", "hidden_bytes")
    }
    for key in ("cost_usd", "generation_gpu_hours", "hidden_gpu_hours"):  # None where nothing applies
        known = [getattr(r, key) for r in rows if getattr(r, key) is not None]
        total[key] = sum(known) if known else None
    results.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(results).free
    return {
        "partitions": [asdict(r) for r in rows],
        "total": total,
        "loads": plan_loads(config, jobs or [], logs),
        "free_disk_bytes": free,
        "exceeds_free_disk": total["hidden_bytes"] > free,
    }


def _fmt(value, unit: str = "") -> str:
    if value is None:
        return "-"
    if unit == "bytes":
        for scale, name in ((1 << 40, "TiB"), (1 << 30, "GiB"), (1 << 20, "MiB")):
            if value >= scale:
                return f"{value / scale:.2f} {name}"
        return f"{value} B"
    if unit == "$":
        return f"${value:,.2f}"
    if isinstance(value, float):
        return f"{value:,.2f}" if value < 100 else f"{value:,.0f}"
    return f"{value:,}"


def format_plan(plan: dict) -> str:
    header = "| partition | backend | prompts | prompt tokens | completion tokens (basis) | cost | gen GPU h | hidden GPU h | hidden bytes (basis) |"  # noqa: E501
    lines = [header, "|---|---|---|---|---|---|---|---|---|"]
    for r in plan["partitions"]:
        lines.append(
            f"| {r['partition']} | {r['backend']} | {_fmt(r['prompts'])} | {_fmt(r['prompt_tokens'])} | "
            f"{_fmt(r['completion_tokens'])} ({r['completion_basis']}) | {_fmt(r['cost_usd'], '$')} | "
            f"{_fmt(r['generation_gpu_hours'])} | {_fmt(r['hidden_gpu_hours'])} | "
            f"{_fmt(r['hidden_bytes'], 'bytes')} ({r['hidden_basis']}) |"
        )
    t = plan["total"]
    lines.append(
        f"| **total** | | {_fmt(t['prompts'])} | {_fmt(t['prompt_tokens'])} | {_fmt(t['completion_tokens'])} | "
        f"{_fmt(t['cost_usd'], '$')} | {_fmt(t['generation_gpu_hours'])} | {_fmt(t['hidden_gpu_hours'])} | "
        f"{_fmt(t['hidden_bytes'], 'bytes')} |"
    )
    lines += ["", "| model | loads | seconds each (basis) | load hours |", "|---|---|---|---|"]
    for model, load in plan["loads"].items():
        lines.append(
            f"| {model.replace('_', ' ')} | {load['loads']} | {_fmt(load['seconds_each'])} ({load['basis']}) | "
            f"{_fmt(load['hours'])} |"
        )
    if not plan["partitions"]:
        lines.append("\nNothing to regenerate: every partition is up to date.")
    if plan["exceeds_free_disk"]:
        lines.append(
            f"\nWARNING: hidden states need {_fmt(t['hidden_bytes'], 'bytes')}, but only "
            f"{_fmt(plan['free_disk_bytes'], 'bytes')} are free under results/"
        )
    return "\n".join(lines)
