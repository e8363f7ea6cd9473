"""What the jobs that read the states ask for, derived from the bytes they read: threads, mem_mb, runtime;
and an API responses job's runtime, from the plan of its shard (`api_responses_minutes`).

The export, probe and vocab rules call these (rules/common.smk). Snakemake evaluates a job's resources
again once its inputs exist (before it runs or is submitted), so they follow the shards' own index.json
(tokens, bytes, the largest part); before that (a dry-run) a shard not yet captured counts as empty, and
the job shows the least it asks for. Work is counted in the states' bf16 bytes at the per-core rates
measured at 7168 wide on the 2-core test machine (BENCHMARKS.md, `bench/states_cpu.py`): a node's cores
are faster, so runtimes are upper bounds; threads are what would finish the job in about TARGET_SECONDS,
within Snakemake's --cores and --max-threads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from eagle3_datagen.backends.base import generation_limit
from eagle3_datagen.backends.plugins import GENERATION
from eagle3_datagen.formats import storage
from eagle3_datagen.formats.checkpoint import text_config
from eagle3_datagen.formats.files import iter_jsonl, read_json
from eagle3_datagen.formats.trainer_exports import EXPORTS
from eagle3_datagen.workflow import disk
from eagle3_datagen.workflow.partitions import inference_backend, shard_names
from eagle3_datagen.workflow.settings import sampling_for

DECODE_RATE = 516e6  # a shard's parts read back (zstd_planes; plain parts are faster)
HEAD_FLOPS = 20e9  # the probe's LM head, bf16 matmul on one core
TOKEN_SHARD_RATE = 10e6  # compressed token-shard bytes the vocab job parses per second
BASE_MB = 3_000  # a job's Python, torch and libraries
TARGET_SECONDS = 3_600
MAX_THREADS = 64
RUNTIME_MARGIN = 3.0
RUNTIME_FLOOR_MINUTES = 15


@dataclass(frozen=True)
class JobSize:
    threads: int
    mem_mb: int
    runtime: int  # minutes


@dataclass(frozen=True)
class ShardReads:
    """What a job reading some shards reads: their tokens and samples, their states in bf16, their largest
    part before compression, and the largest sample's bytes (at most tokens.max_length tokens)."""

    tokens: int
    samples: int
    bf16_bytes: int
    largest_part: int
    largest_sample: int

    @property
    def mean_sample(self) -> int:
        return self.bf16_bytes // max(1, self.samples)


def shard_reads(config: dict, shard_dirs: list[str]) -> ShardReads:
    """From each shard's index.json (a shard not captured yet reads nothing)."""
    per_token = disk.stored_states(config).bf16_bytes_per_token
    tokens = samples = largest = 0
    for shard in map(Path, shard_dirs):
        if (shard / "index.json").is_file():
            index = read_json(shard / "index.json")
            tokens += index["tokens"]
            samples += index["samples"]
            largest = max([largest, *(p.get("raw_bytes", p["bytes"]) for p in index["parts"])])
    sample = min(largest, config["tokens"]["max_length"] * per_token)
    return ShardReads(tokens, samples, tokens * per_token, largest, sample)


def _threads(work_seconds: float) -> int:
    return max(1, min(MAX_THREADS, math.ceil(work_seconds / TARGET_SECONDS)))


def _minutes(work_seconds: float, threads: int) -> int:
    return RUNTIME_FLOOR_MINUTES + math.ceil(work_seconds / threads * RUNTIME_MARGIN / 60)


def export_job(config: dict, shard_dirs: list[str], fmt: str, threads: int | None = None) -> JobSize:
    """An export of `shard_dirs` in `fmt`: its work at the format's rate; in memory, the parts read ahead
    (storage.export_read_ahead), each decoded beside its compressed bytes, and two samples' files per
    thread (one writing, one queued), the largest ones twice."""
    reads = shard_reads(config, shard_dirs)
    work = reads.bf16_bytes / EXPORTS[fmt].rate(config)
    threads = threads or _threads(work)
    parts = (storage.export_read_ahead(threads) + 1) * reads.largest_part * 2
    samples = threads * 2 * reads.mean_sample + 2 * reads.largest_sample
    return JobSize(threads, BASE_MB + math.ceil((parts + samples) / 1e6), _minutes(work, threads))


def _vocabulary(config: dict) -> int:
    """The model's vocabulary, else a large target's (Kimi-K2.5: 163,840) until its config.json says it (the
    preflight names a model directory that lacks what the jobs need)."""
    path = Path(config["model"]["path"]) / "config.json"
    model = text_config(config["model"]["path"]) if path.exists() else {}
    return int(model.get("vocab_size") or 200_000)


def probe_job(config: dict, shard_dir: str, threads: int | None = None) -> JobSize:
    """A probe of one shard: every part read back (its ids and masks, and the probed states), and the LM head
    applied to probe.max_positions states and to their neighbours on either side (the alignment floor), once
    more on fp8's reference rows; in memory, the head, one decoded part beside its compressed bytes, the three
    probed rows of each position and a chunk of logits."""
    reads = shard_reads(config, [shard_dir])
    hidden = disk.stored_states(config).hidden_size
    vocabulary = _vocabulary(config)
    positions = min(config["probe"]["max_positions"], reads.tokens)
    passes = 4 if config["hidden_states"]["dtype"] in storage.FP8 else 3
    work = reads.bf16_bytes / DECODE_RATE + passes * 2 * positions * hidden * vocabulary / HEAD_FLOPS
    threads = threads or max(1, min(8, math.ceil(work / 600)))
    memory = vocabulary * hidden * 2 + reads.largest_part * 2 + 3 * positions * hidden * 2 + 1024 * vocabulary * 8
    return JobSize(threads, BASE_MB + math.ceil(memory / 1e6), _minutes(work, threads))


def vocab_job(config: dict, token_shards: list[str]) -> JobSize:
    """The draft vocabulary over every token shard: one thread parsing them, counts over the vocabulary."""
    size = sum(Path(p).stat().st_size for p in token_shards if Path(p).is_file())
    work = size / TOKEN_SHARD_RATE
    return JobSize(1, BASE_MB + math.ceil(_vocabulary(config) * 8 * 4 / 1e6), _minutes(work, 1))


def observed_completion_per_turn(partition: str, results: str | Path = "results") -> float | None:
    """The completion tokens per regenerated turn of the partition's finished response shards, if any."""
    turns = tokens = 0
    for path in sorted((Path(results) / partition / "responses").glob("*.stats.json")):
        stats = read_json(path)
        turns += stats.get("assistant_turns", 0)
        tokens += stats.get("usage", {}).get("completion_tokens", 0)
    return tokens / turns if turns else None


def responses_minutes(config: dict, partition: str, prompts: str, results: str | Path = "results") -> int:
    """The time limit of a responses job that no launched server answers: a priced API's from the plan
    (`api_responses_minutes`), unless `resources.jobs.responses.api_runtime` sets it; any other's
    `resources.jobs.responses.runtime`."""
    jobs = config["resources"]["jobs"]["responses"]
    if not GENERATION[inference_backend(config, partition)].priced:
        return jobs["runtime"]
    return jobs["api_runtime"] or api_responses_minutes(config, partition, prompts, results)


def api_responses_minutes(config: dict, partition: str, prompts: str, results: str | Path = "results") -> int:
    """An API responses job's runtime: the shard's user turns, each answered in its completion tokens (the
    partition's observed mean, else the max tokens: an upper bound) at `api_answer_tokens_per_s`, over the
    job's share of the endpoint's concurrency. Every API shard of the run is submitted at once and the
    ledger splits the concurrency evenly among the live jobs, so a job's share is the concurrency over the
    API shards: a job lives about as long as the whole generation. A shard not written yet (a dry-run)
    counts as empty: the floor."""
    backend = inference_backend(config, partition)
    section = GENERATION[backend].settings(config)
    turns = sum(
        sum(m["role"] == "user" for m in prompt["messages"])
        for _, prompt in (iter_jsonl(prompts) if Path(prompts).is_file() else ())
    )
    per_turn = observed_completion_per_turn(partition, results) or generation_limit(
        section, sampling_for(config, backend)
    )
    api_shards = sum(
        len(shard_names(config, p)) for p in config["partitions"] if GENERATION[inference_backend(config, p)].priced
    )
    share = section["concurrency"] / max(1, api_shards)
    seconds = turns * per_turn / config["resources"]["jobs"]["responses"]["api_answer_tokens_per_s"]
    return _minutes(seconds, share)
