"""What a run would cost, before it runs: prompts, tokens, dollars, node-hours and disk.

The partitions counted are the ones Snakemake's dry-run would regenerate (their responses,
hidden-state or export jobs are scheduled), so the plan agrees with `snakemake -n`. Prompt tokens are
counted by rendering each prompt with the model's own chat template; completion tokens are
estimated from the configured max tokens (an upper bound) or, when earlier response shards
exist, from their observed completion tokens per turn. Once a partition's token shards exist, its
bytes are counted from their measured tokens. The disk counts every output of the states
(workflow/disk.py): the shards and each export format in its own bytes, the most they take at once,
what stays at the end (the exports alone where the shards are released) and whether the
filesystem each goes to has room. The capture's hours are at the slower of the node's forward
passes (`plan.throughput.prefill_tokens_per_s`) and its CPU side (the capture job's cores at the
measured bytes per core a second). No model is loaded or called.

It also counts how often each big model loads in the planned run: the generation server and the
capture runner once on the node when any scheduled shard needs it (the node's shard jobs share it);
under a cluster executor once per allocation (a group job, or a job outside any group); each load at
`plan.load_seconds`, or what the services' load records (`formats/service_loads.py`) measured in earlier
runs of the same model. Node-hours come from `plan.throughput`'s rates, or from what the smoke run
measured on the node for the same model (`formats/measured_rates.py`).
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import NamedTuple

from eagle3_datagen.backends.base import generation_limit
from eagle3_datagen.backends.plugins import GENERATION, RESPONSE_RULES
from eagle3_datagen.chat.template import load_tokenizer, render_ids
from eagle3_datagen.chat.tiktoken_fast import fast_tokenizer_from_tiktoken
from eagle3_datagen.formats import storage
from eagle3_datagen.formats.files import iter_jsonl
from eagle3_datagen.formats.released import RELEASED
from eagle3_datagen.formats.service_loads import read_loads
from eagle3_datagen.workflow import disk
from eagle3_datagen.workflow.job_resources import observed_completion_per_turn
from eagle3_datagen.workflow.partitions import (
    inference_backend,
    prompt_partition,
    served_by_launched_server,
    shard_names,
)
from eagle3_datagen.workflow.rates import capture_rates, plan_rates
from eagle3_datagen.workflow.settings import curve_fractions, one_pass_states, sampling_for


class ScheduledJob(NamedTuple):
    rule: str
    partition: str | None
    group: int | None  # the group job (one allocation under a cluster executor) it runs in, if any


_GROUP = re.compile(r"^\[.*?\] Group job (\S+)")
_RULE = re.compile(r"^(\s*)rule (\S+):$")
_PARTITION = re.compile(r"^\s*wildcards: partition=([\w.+-]+)")  # `+`: a baseline partition (P+original)


def scheduled_jobs(dry_run_output: str) -> list[ScheduledJob]:
    """Every job a dry-run lists (`snakemake -n`), with the group job it belongs to: a group's jobs are
    listed indented under its "Group job NAME" line."""
    jobs: list[ScheduledJob] = []
    groups = 0
    in_group = False
    for line in dry_run_output.splitlines():
        if _GROUP.match(line):
            groups += 1
            in_group = True
        elif match := _RULE.match(line):
            in_group = in_group and bool(match[1])
            jobs.append(ScheduledJob(match[2], None, groups if in_group else None))
        elif (match := _PARTITION.match(line)) and jobs:
            jobs[-1] = jobs[-1]._replace(partition=match[1])
    return jobs


def scheduled_partitions(jobs: list[ScheduledJob], rules=(*RESPONSE_RULES, "hidden_states", "export")) -> set[str]:
    """Partitions with a job of `rules` among `jobs`."""
    return {job.partition for job in jobs if job.rule in rules and job.partition}


def measured_loads(logs: Path, service: str, model: str) -> list[float]:
    """Seconds each earlier load of `model` by `service` took, from the services' load records under `logs`."""
    return [r["seconds"] for r in read_loads(logs) if r["service"] == service and r["model"] == model]


def count_loads(jobs: list[ScheduledJob], per_allocation: bool) -> int:
    """How many times a node service that `jobs` share loads: once on the node (local and gpu profiles);
    under a cluster executor once per allocation, i.e. per group job, and per job outside any group."""
    if not per_allocation:
        return int(bool(jobs))
    return len({job.group for job in jobs if job.group is not None}) + sum(job.group is None for job in jobs)


def plan_loads(config: dict, jobs: list[ScheduledJob], logs: str | Path = "logs", per_allocation: bool = False) -> dict:
    """Per model: how many times the planned run loads it, seconds per load (and their basis), hours."""
    served = {p for p in config["partitions"] if served_by_launched_server(config, p)}
    generating = [j for j in jobs if j.rule in RESPONSE_RULES and j.partition in served]
    # a one-pass partition's capture jobs pack what its server saved: no model loads for them
    capturing = [j for j in jobs if j.rule == "hidden_states" and one_pass_states(config, j.partition) is None]
    # the shard jobs of a node (an allocation) share one server, and one capture runner
    counts = {
        "generation_server": count_loads(generating, per_allocation),
        "capture_runner": count_loads(capturing, per_allocation),
    }
    configured = config["plan"]["load_seconds"]
    model = str(Path(config["model"]["path"]).resolve())  # as the services record it
    loads = {}
    for service, count in counts.items():
        seen = measured_loads(Path(logs), service, model)
        seconds = sum(seen) / len(seen) if seen else configured[service]
        basis = f"measured, mean of {len(seen)} in logs/" if seen else "plan.load_seconds"
        loads[service] = {"loads": count, "seconds_each": seconds, "basis": basis, "hours": count * seconds / 3600}
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
    generation_node_hours: float | None
    hidden_node_hours: float | None
    hidden_basis: str
    hidden_bytes: int  # the shards
    disk: dict = field(default_factory=dict)  # workflow/disk.PartitionBytes.as_dict: shards, exports, peak, end
    capture_rate: dict = field(default_factory=dict)  # the forward passes' and the CPU side's tokens/s
    # hidden_states.one_pass: the capture's prefill is not run (its node-hours at the prefill rate, None
    # without one), and the server's states lie beside the responses until packed (staged_bytes)
    one_pass: dict | None = None


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def plan_tokenizer(config: dict):
    """The model's tokenizer, from model.path, else from `plan.tokenizer` (where the model directory is not
    on this machine): a directory a tokenizer loads from, or Kimi's tokenizer files (a tiktoken.model,
    read as a fast tokenizer with the same IDs, since Moonshot's remote code is not there)."""
    model = config["model"]
    trust = model["trust_remote_code"]
    if _has_tokenizer(model["path"]):
        return load_tokenizer(model["path"], trust)
    if "demo" in config:  # the workflow builds the model; its tokenizer is known before
        from eagle3_datagen.targets.demo import demo_tokenizer

        return demo_tokenizer(config["demo"])
    directory = config["plan"]["tokenizer"]
    if directory and (Path(directory) / "tokenizer.json").is_file():
        return load_tokenizer(directory, trust)
    if directory and (Path(directory) / "tiktoken.model").is_file():
        return fast_tokenizer_from_tiktoken(directory)
    raise FileNotFoundError(
        f"model.path {model['path']} holds no tokenizer"
        + (f", nor does plan.tokenizer {directory}" if directory else "")
        + ", and the plan counts prompt tokens with it: mount the model there, or set plan.tokenizer to a "
        "directory with its tokenizer files and chat template"
    )


def _has_tokenizer(directory: str) -> bool:
    return any((Path(directory) / name).is_file() for name in TOKENIZER_FILES)


def plan_partition(
    config: dict, partition: str, tokenizer, results: Path, tokens_scheduled: bool = True, rates: dict | None = None
) -> PartitionPlan:
    """One partition's prompts, tokens, cost, hours and bytes; `tokens_scheduled`: its token shards are
    about to be written (else existing ones give the measured tokens); `rates`: `plan_rates`'."""
    backend = inference_backend(config, partition)
    inference = config["inference"]
    max_tokens = generation_limit(inference.get(backend) or {}, sampling_for(config, backend))  # hf, dataset: none
    template_kwargs = config["model"]["chat_template_kwargs"]
    prompts = user_turns = prompt_tokens = 0
    for shard in shard_names(config, partition):
        for _, prompt in iter_jsonl(results / prompt_partition(partition) / "prompts" / f"{shard}.jsonl.zst"):
            prompts += 1
            user_turns += sum(m["role"] == "user" for m in prompt["messages"])
            prompt_tokens += len(render_ids(tokenizer, prompt["messages"], True, template_kwargs))
    observed = observed_completion_per_turn(partition, results)
    per_turn = observed if observed is not None else max_tokens
    completion = round(user_turns * per_turn)
    basis = f"observed {observed:.0f} per turn" if observed is not None else f"max tokens {max_tokens} per turn"
    # no prices, no throughput: no cost, no node-hours
    generation = GENERATION[backend]
    prices = generation.settings(config).get("price_per_million") if generation.priced else None
    cost = prompt_tokens / 1e6 * prices["prompt"] + completion / 1e6 * prices["completion"] if prices else None
    rates = rates or plan_rates(config)
    generate_rate = rates["generate_tokens_per_s"]["tokens_per_s"]
    tokens = None if tokens_scheduled else disk.measured_tokens(config, partition, results)
    samples = user_turns if config["tokens"]["thinking"] == "keep_all" else prompts
    tokens = tokens or disk.Tokens(prompt_tokens + completion, samples, f"estimate (prompt tokens, {basis})")
    counted = disk.partition_bytes(config, partition, tokens, results)
    states = disk.stored_states(config)
    per_token = storage.shard_bytes_per_token(
        states.dtype, states.scales, states.scale_block, states.aux_layers, states.hidden_size
    )
    capture = capture_rates(config, per_token, rates["prefill_tokens_per_s"]["tokens_per_s"])
    capture_rate = capture["tokens_per_s"] if "gpu_tokens_per_s" in capture else None
    one_pass = None
    if one_pass_states(config, partition) is not None:
        prefill = capture.get("gpu_tokens_per_s")
        one_pass = {
            "prefill_node_hours_saved": tokens.tokens / prefill / 3600 if prefill else None,
            "staged_bytes": tokens.tokens * disk.staged_bytes_per_token(config, states),
        }
        capture_rate = capture["cpu_tokens_per_s"]  # packing: the CPU side only
    return PartitionPlan(
        partition=partition,
        backend=backend,
        prompts=prompts,
        user_turns=user_turns,
        prompt_tokens=prompt_tokens,
        completion_tokens=completion,
        completion_basis=basis,
        cost_usd=cost,
        generation_node_hours=(completion / generate_rate / 3600 if generate_rate and generation.on_node else None),
        hidden_node_hours=tokens.tokens / capture_rate / 3600 if capture_rate else None,
        hidden_bytes=counted.shards,
        hidden_basis=f"{states.dtype}, {per_token} B/token; {'; '.join(counted.basis)}",
        disk=counted.as_dict(),
        capture_rate=capture,
        one_pass=one_pass,
    )


def measured_draft_minutes(benchmarks: Path, copies: int) -> float | None:
    """Minutes per draft in earlier evaluate jobs here (their Snakemake benchmarks: each job trains and
    decodes `copies` drafts), None before any ran."""
    seconds = [
        float(line.split("\t")[0])
        for tsv in [*benchmarks.glob("**/evaluate/evaluate.tsv"), *benchmarks.glob("**/evaluate/curve/*.tsv")]
        for line in tsv.read_text().splitlines()[1:2]
    ]
    return sum(seconds) / len(seconds) / copies / 60 if seconds else None


def plan_evaluation(
    config: dict, rows: list[PartitionPlan], rates: dict | None = None, benchmarks: str | Path = "benchmarks"
) -> dict | None:
    """The evaluate stage's cost for the planned partitions (None without the stage): a draft per
    partition and one on all of them together, as many again for each point of the data curve below the
    whole (`evaluate.fractions`), twice each with `evaluate.baseline: original`; `evaluate.steps`
    SpecForge steps of `batch_size` samples each (a sample's tokens: the partition's mean; a curve's
    draft trains as many steps as the whole's), and up to `max_new_tokens` decoded per held-out prompt,
    each draft on its own held-out prompts (the all-partitions draft on every one). Node-hours at
    `plan.throughput`'s rates: training at `train_tokens_per_s`, decoding at `generate_tokens_per_s` (an
    upper bound: speculative decoding commits several tokens per target step); minutes per draft as the
    earlier evaluate jobs here took (`benchmarks`), on the CPU or, with `evaluate.device: cuda`, a GPU."""
    if "evaluate" not in config or not rows:
        return None
    evaluate = config["evaluate"]
    together = len(config["partitions"]) > 1
    per_sample = [(r.prompt_tokens + r.completion_tokens) / max(r.prompts, 1) for r in rows]
    sample_tokens = sum(per_sample) + (
        sum(r.prompt_tokens + r.completion_tokens for r in rows) / max(sum(r.prompts for r in rows), 1)
        if together
        else 0
    )
    decoded = sum(min(evaluate["holdout"], r.prompts) for r in rows) * evaluate["max_new_tokens"]
    copies = 2 if evaluate["baseline"] == "original" else 1
    sizes = 1 + len(curve_fractions(config))  # the whole and each smaller point of the data curve
    drafts = (len(rows) + together) * copies * sizes
    train_tokens = round(evaluate["steps"] * evaluate["batch_size"] * sample_tokens * copies * sizes)
    decoded_tokens = decoded * (1 + together) * copies * sizes
    rates = rates or plan_rates(config)
    train_rate = rates["train_tokens_per_s"]["tokens_per_s"]
    generate_rate = rates["generate_tokens_per_s"]["tokens_per_s"]
    per_draft = measured_draft_minutes(Path(benchmarks), copies)
    return {
        "drafts": drafts,
        "curve_drafts": drafts - drafts // sizes,
        "training_steps": drafts * evaluate["steps"],
        "training_tokens": train_tokens,
        "decoded_tokens": decoded_tokens,
        # no rate, no hours
        "node_hours": train_tokens / train_rate / 3600 + decoded_tokens / generate_rate / 3600
        if train_rate and generate_rate
        else None,
        "device": "GPU" if evaluate["device"] == "cuda" else "CPU",
        "minutes_per_draft": per_draft,
        "minutes": per_draft * drafts if per_draft is not None else None,
    }


def recaptures(config: dict, jobs: list[ScheduledJob], results: Path) -> list[str]:
    """Partitions whose released shards (hidden_states.keep_shards: false) the run captures again: what shapes
    their states changed. The preflight stops such a run with its price (what reads the states reruns from the
    kept copy and is not counted here)."""
    capturing = {j.partition for j in jobs if j.rule == "hidden_states" and j.partition}
    return sorted(p for p in capturing if any((results / p / "hidden").glob(f"*/{RELEASED}")))


def make_plan(
    config: dict,
    partitions: list[str],
    results: str | Path = "results",
    jobs: list[ScheduledJob] | None = None,
    logs: str | Path = "logs",
    per_allocation: bool = False,
) -> dict:
    """`jobs`: the dry-run's, to count model loads (none counted without them) and to tell which
    partitions' token shards are rewritten; `per_allocation`: the run submits its jobs to a cluster (each
    job or group job is an allocation of its own)."""
    results = Path(results)
    jobs = jobs or []
    tokenizer = plan_tokenizer(config)
    rates = plan_rates(config, logs)
    tokens_rewritten = {j.partition for j in jobs if j.rule == "tokens"} if jobs else set(partitions)
    rows = [plan_partition(config, p, tokenizer, results, p in tokens_rewritten, rates) for p in sorted(partitions)]
    total = {
        key: sum(getattr(r, key) for r in rows)
        for key in ("prompts", "user_turns", "prompt_tokens", "completion_tokens", "hidden_bytes")
    }
    for key in ("cost_usd", "generation_node_hours", "hidden_node_hours"):  # None where nothing applies
        known = [getattr(r, key) for r in rows if getattr(r, key) is not None]
        total[key] = sum(known) if known else None
    for key in ("tokens", "bf16_bytes", "peak_bytes", "end_bytes"):
        total[key] = sum(r.disk[key] for r in rows)
    total["export_bytes"] = {}
    for r in rows:
        for fmt, size in r.disk["export_bytes"].items():
            total["export_bytes"][fmt] = total["export_bytes"].get(fmt, 0) + size
    results.mkdir(parents=True, exist_ok=True)
    writes = []
    for r in rows:
        writes.append((r.partition, results / r.partition / "hidden", r.disk["shard_bytes"]))
        writes += [(r.partition, results / r.partition / "export" / f, b) for f, b in r.disk["export_bytes"].items()]
    filesystems = [
        {
            "where": str(n.where),
            "free_bytes": n.room.left,  # the room: free space, or what a quota leaves where it is less
            "room": n.room.said,
            "needed_bytes": n.needed,
            "partitions": n.partitions,
        }
        for n in disk.needs_by_filesystem(writes, results, config["resources"]["disk_quota_bytes"])
    ]
    return {
        "partitions": [asdict(r) for r in rows],
        "total": total,
        "loads": plan_loads(config, jobs, logs, per_allocation),
        "rates": rates,
        "evaluation": plan_evaluation(config, rows, rates),
        "filesystems": filesystems,
        "exceeds_free_disk": any(f["needed_bytes"] > f["free_bytes"] for f in filesystems),
        "recapture": recaptures(config, jobs, results),
    }


def _fmt(value, unit: str = "") -> str:
    if value is None:
        return "-"
    if unit == "bytes":
        for scale, name in ((1 << 40, "TiB"), (1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")):
            if value >= scale:
                return f"{value / scale:.2f} {name}"
        return f"{value} B"
    if unit == "$":
        return f"${value:,.2f}"
    if isinstance(value, float):
        return f"{value:,.2f}" if value < 100 else f"{value:,.0f}"
    return f"{value:,}"


def format_plan(plan: dict) -> str:
    header = "| partition | backend | prompts | prompt tokens | completion tokens (basis) | cost | gen node-h | hidden node-h | hidden bytes (basis) |"  # noqa: E501
    lines = [header, "|---|---|---|---|---|---|---|---|---|"]
    for r in plan["partitions"]:
        lines.append(
            f"| {r['partition']} | {r['backend']} | {_fmt(r['prompts'])} | {_fmt(r['prompt_tokens'])} | "
            f"{_fmt(r['completion_tokens'])} ({r['completion_basis']}) | {_fmt(r['cost_usd'], '$')} | "
            f"{_fmt(r['generation_node_hours'])} | {_fmt(r['hidden_node_hours'])} | "
            f"{_fmt(r['hidden_bytes'], 'bytes')} ({r['hidden_basis']}) |"
        )
    t = plan["total"]
    lines.append(
        f"| **total** | | {_fmt(t['prompts'])} | {_fmt(t['prompt_tokens'])} | {_fmt(t['completion_tokens'])} | "
        f"{_fmt(t['cost_usd'], '$')} | {_fmt(t['generation_node_hours'])} | {_fmt(t['hidden_node_hours'])} | "
        f"{_fmt(t['hidden_bytes'], 'bytes')} |"
    )
    if plan.get("rates"):
        lines += ["", "| rate | tokens/s (basis) |", "|---|---|"]
        for name, rate in plan["rates"].items():
            lines.append(f"| {name.removesuffix('_tokens_per_s')} | {_fmt(rate['tokens_per_s'])} ({rate['basis']}) |")
    lines += ["", "| model | loads | seconds each (basis) | load hours |", "|---|---|---|---|"]
    for model, load in plan["loads"].items():
        lines.append(
            f"| {model.replace('_', ' ')} | {load['loads']} | {_fmt(load['seconds_each'])} ({load['basis']}) | "
            f"{_fmt(load['hours'])} |"
        )
    if evaluation := plan.get("evaluation"):
        lines += [
            "",
            f"| evaluation | drafts (data curve's) | training steps | training tokens | decoded tokens | node-h | "
            f"{evaluation['device']} minutes (per draft, measured here) |",
            "|---|---|---|---|---|---|---|",
            f"| evaluate | {evaluation['drafts']} ({evaluation['curve_drafts']}) | "
            f"{_fmt(evaluation['training_steps'])} | {_fmt(evaluation['training_tokens'])} | "
            f"{_fmt(evaluation['decoded_tokens'])} | {_fmt(evaluation['node_hours'])} | "
            f"{_fmt(evaluation['minutes'])} ({_fmt(evaluation['minutes_per_draft'])}) |",
        ]
    lines += _disk_lines(plan)
    if not plan["partitions"]:
        lines.append("\nNothing to regenerate: every partition is up to date.")
    for fs in plan["filesystems"]:
        if fs["needed_bytes"] > fs["free_bytes"]:
            lines.append(
                f"\nWARNING: the shards and exports of {', '.join(fs['partitions'])} need up to "
                f"{_fmt(fs['needed_bytes'], 'bytes')} at once, but only {_fmt(fs['free_bytes'], 'bytes')} are "
                f"{fs['room']}"
            )
    lines += _one_pass_lines(plan)
    if plan["recapture"]:
        lines.append(
            f"\nWARNING: the released shards of {', '.join(plan['recapture'])} would be captured again (what shapes "
            "their states changed) while their parts were removed after the exports (hidden_states.keep_shards: "
            "false): the run stops before its first job, naming the price (the hidden node-hours above). Delete "
            "results/<partition>/hidden to pay it, or set back what changed"
        )
    return "\n".join(lines)


def _disk_lines(plan: dict) -> list[str]:
    """The states' outputs per partition: shards, each export, at most at once, and what stays at the end."""
    if not plan["partitions"]:
        return []
    lines = [
        "",
        "| disk | tokens (basis) | states in bf16 | shards | exports | at most at once | at the end |",
        "|---|---|---|---|---|---|---|",
    ]

    def exports(sizes: dict) -> str:
        return ", ".join(f"{fmt} {_fmt(size, 'bytes')}" for fmt, size in sizes.items()) or "-"

    def end(d: dict) -> str:
        ratio = f" ({d['end_bytes'] / d['bf16_bytes']:.2f}x bf16)" if d["bf16_bytes"] else ""
        return _fmt(d["end_bytes"], "bytes") + ratio + ("; shards released" if d.get("shards_released") else "")

    for r in plan["partitions"]:
        d = r["disk"]
        lines.append(
            f"| {r['partition']} | {_fmt(d['tokens'])} ({d['tokens_basis']}) | {_fmt(d['bf16_bytes'], 'bytes')} | "
            f"{_fmt(d['shard_bytes'], 'bytes')} | {exports(d['export_bytes'])} | {_fmt(d['peak_bytes'], 'bytes')} | "
            f"{end(d)} |"
        )
    t = plan["total"]
    total = {**t, "shards_released": False}
    lines.append(
        f"| **total** | {_fmt(t['tokens'])} | {_fmt(t['bf16_bytes'], 'bytes')} | {_fmt(t['hidden_bytes'], 'bytes')} | "
        f"{exports(t['export_bytes'])} | {_fmt(t['peak_bytes'], 'bytes')} | {end(total)} |"
    )
    lines.append("")
    lines.append(f"bytes counted with: {'; '.join(plan['partitions'][0]['hidden_basis'].split('; ')[1:])}")
    rate = plan["partitions"][0]["capture_rate"]
    cpu = f"CPU side {_fmt(rate['cpu_tokens_per_s'])} tokens/s ({rate['cpu_cores']} cores)"
    if "gpu_tokens_per_s" in rate:
        side = "CPU side's" if rate["bound_by"] == "cpu" else "forward passes'"
        lines.append(
            f"capture: forward passes {_fmt(rate['gpu_tokens_per_s'])} tokens/s, {cpu}: hours at the {side} rate"
        )
    else:
        lines.append(f"capture: {cpu}; no plan.throughput.prefill_tokens_per_s, so no hours")
    for fs in plan["filesystems"]:
        lines.append(
            f"filesystem at {fs['where']}: up to {_fmt(fs['needed_bytes'], 'bytes')} at once, "
            f"{_fmt(fs['free_bytes'], 'bytes')} {fs['room'].split(' on the filesystem at ')[0]}"
        )
    return lines


def _one_pass_lines(plan: dict) -> list[str]:
    """What hidden_states.one_pass changes: the capture prefill it saves, the disk its staged states take."""
    rows = [r for r in plan["partitions"] if r.get("one_pass")]
    if not rows:
        return []
    saved = [r["one_pass"]["prefill_node_hours_saved"] for r in rows]
    hours = _fmt(sum(saved)) if None not in saved else "n/a (no plan.throughput.prefill_tokens_per_s)"
    staged = sum(r["one_pass"]["staged_bytes"] for r in rows)
    return [
        f"\none pass (hidden_states.one_pass): {', '.join(r['partition'] for r in rows)} save their states in the "
        f"generation request; their capture jobs only pack them (hidden node-h above: the CPU side), saving a "
        f"prefill of {hours} node-h; the server's states lie beside the responses until packed: up to "
        f"{_fmt(staged, 'bytes')} (a multi-turn conversation's earlier turns' files until its shard ends too)"
    ]
