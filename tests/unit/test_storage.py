"""Every byte of the states counted, one copy kept, and the capture's CPU side beside the forward passes:
the byte model against real shards and exports, the release of a partition's shards, parallel exports,
the capture's writer threads, and the jobs' resources derived from their bytes."""

import gzip
import json
import math
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import yaml

from eagle3_datagen.backends.hf.capture import HFCapture
from eagle3_datagen.config_schema import fill_defaults
from eagle3_datagen.formats import storage
from eagle3_datagen.formats.hidden_shard import HiddenShard, ShardReleased, release_parts
from eagle3_datagen.formats.trainer_exports import EXPORTS
from eagle3_datagen.reporting.plan import capture_rates
from eagle3_datagen.stages.export import export
from eagle3_datagen.stages.hidden import shard as shard_module
from eagle3_datagen.stages.hidden.shard import capture_shard
from eagle3_datagen.workflow import job_resources
from tests.helpers import HIDDEN_SETTINGS as SETTINGS
from tests.helpers import REPO, make_samples, prompts_file

SPECFORGE, SPECULATORS = EXPORTS["specforge"], EXPORTS["speculators"]
GZIP = fill_defaults({"specforge": {"compress": "gzip", "compress_level": 1}}, "export")
STORED = {
    "bf16-planes": {"dtype": "bfloat16", "compress": "zstd_planes"},
    "e4m3-token": {"dtype": "float8_e4m3", "scales": "token", "compress": "zstd"},
    "e5m2-channel": {"dtype": "float8_e5m2", "scales": "channel"},
}


@pytest.fixture(scope="module")
def raw_capture(tiny_model_dir):
    return HFCapture(tiny_model_dir, "auto", "raw", {"dtype": "float32", "device": "cpu"})


def files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("stored", STORED.values(), ids=STORED.keys())
def test_the_byte_model_counts_real_shards_and_exports(tmp_path, raw_capture, tiny_model_dir, stored):
    """formats/storage.py's bytes against what the capture and each export write, at hidden 32 (where the
    files' framing weighs most): within 2% with the observed ratio."""
    samples = make_samples(30, seed=8, lo=20, hi=120)
    index = capture_shard(samples, tmp_path / "00000", raw_capture, {**SETTINGS, **stored, "shard_bytes": 40_000})
    states = storage.States.from_settings(fill_defaults(dict(stored), "hidden_states"), 3, 32)
    tokens, count = index["tokens"], index["samples"]
    ratio = index["bytes"] / index["raw_bytes"]
    assert states.shard_bytes(tokens, count, len(index["parts"]), ratio) == pytest.approx(index["bytes"], rel=0.02)
    for name, (fmt, settings) in {
        "specforge": ("specforge", {}),
        "specforge-gzip": ("specforge", GZIP),
        "speculators": ("speculators", {}),
    }.items():
        summary = export([tmp_path / "00000"], tmp_path / name, fmt, model_path=tiny_model_dir, settings=settings)
        written = sum(len(data) for data in files(tmp_path / name).values())
        assert summary["bytes"] <= written <= summary["bytes"] + 30_000  # export.json itself is not in its sum
        gzip_ratio = None
        if settings:
            rows = summary["rows"]
            gzip_ratio = rows["bytes"] / rows["raw_bytes"]
            assert rows["compress"] == "gzip" and gzip_ratio < 1
        predicted = states.export_bytes(EXPORTS[fmt].files, tokens, count, gzip_ratio)
        assert predicted == pytest.approx(written, rel=0.02), name


def test_the_one_copy_of_kimi_states_is_at_most_their_bf16_bytes():
    """What docs/plan.md's table says for the Kimi configs' storage, per 300M tokens in 100k samples."""
    kimi = storage.States(3, 7168, "bfloat16", "token", 128, "zstd_planes")
    tokens, samples = 300_000_000, 100_000
    bf16 = tokens * kimi.bf16_bytes_per_token
    assert bf16 == 17_203_200_000_000  # 17.2 TB
    gzipped = kimi.export_bytes(SPECFORGE.files, tokens, samples, kimi.assumed_gzip_ratio(SPECFORGE.files))
    assert gzipped / bf16 == pytest.approx(0.81, abs=0.005)
    plain = kimi.export_bytes(SPECFORGE.files, tokens, samples, None)
    assert 1.0 < plain / bf16 < 1.001  # int64 ids and masks, and the rows' framing
    fp8 = storage.States(3, 7168, "float8_e4m3", "token", 128, "zstd")
    assert fp8.exported_dtype(SPECULATORS.files) == "float8_e4m3" and fp8.exported_dtype(SPECFORGE.files) == "bfloat16"
    assert fp8.export_bytes(SPECULATORS.files, tokens, samples, None) / bf16 == pytest.approx(0.5, abs=0.01)


def test_released_shards_keep_their_index_and_refuse_readers_with_the_fix(tmp_path, raw_capture):
    samples = make_samples(12, seed=2)
    index = capture_shard(samples, tmp_path / "00000", raw_capture, {**SETTINGS, "shard_bytes": 8_000})
    shard_dir = tmp_path / "00000"
    timestamp = (shard_dir / ".snakemake_timestamp").write_text("") or (shard_dir / ".snakemake_timestamp")
    before = timestamp.stat().st_mtime_ns
    freed = release_parts(shard_dir, ["results/p/export/specforge", "results/p/probe/00000.json"])
    assert freed == index["bytes"] and len(index["parts"]) > 1
    assert sorted(p.name for p in shard_dir.iterdir()) == [".snakemake_timestamp", "index.json", "released.json"]
    assert timestamp.stat().st_mtime_ns == before  # what Snakemake dates the shard by
    record = json.loads((shard_dir / "released.json").read_text())
    assert record["after"] == ["results/p/export/specforge", "results/p/probe/00000.json"]
    assert record["tokens"] == index["tokens"] and record["bytes"] == index["bytes"]
    with pytest.raises(ShardReleased, match=r"its parts were removed .* once results/p/export/specforge, .*") as e:
        HiddenShard(shard_dir)
    assert f"delete {shard_dir} and rerun snakemake" in str(e.value) and "keep_shards: true" in str(e.value)
    assert release_parts(shard_dir, ["again"]) == 0  # again: nothing left to free, the first record stays
    assert json.loads((shard_dir / "released.json").read_text()) == record


def test_the_partitions_release_record_keeps_the_bytes_its_first_release_freed(tmp_path, raw_capture):
    """scripts/release_hidden.py as the release_hidden rule runs it, then again as a rerun after an export
    was rebuilt from the kept copy: the rerun frees nothing, and its record still says what the release freed."""
    shards = [tmp_path / f"p/hidden/{i:05d}" for i in range(2)]
    indexes = [capture_shard(make_samples(6, seed=i), shard, raw_capture, SETTINGS) for i, shard in enumerate(shards)]
    out = tmp_path / "p/hidden/released.json"
    (tmp_path / "p/probe").mkdir()
    (tmp_path / "p/probe/00000.json").write_text('{"passed": true}')  # kept in shard 00000's released.json
    release = [sys.executable, str(REPO / "scripts/release_hidden.py"), "--hidden", *map(str, shards)]
    release += ["--after", str(tmp_path / "p/probe/00000.json"), "--out", str(out)]
    total = sum(index["bytes"] for index in indexes)
    subprocess.run(release, check=True, capture_output=True)
    first = json.loads(out.read_text())
    assert first["bytes_freed"] == first["bytes_released"] == total > 0
    subprocess.run(release, check=True, capture_output=True)
    again = json.loads(out.read_text())
    assert again["bytes_freed"] == 0 and again["bytes_released"] == total
    assert again["shards"] == {str(shard): 0 for shard in shards}
    assert json.loads((shards[0] / "released.json").read_text())["probe"] == {"passed": True}


def test_exports_written_on_several_threads_are_the_bytes_of_one(tmp_path, raw_capture, tiny_model_dir):
    """Sample numbers are fixed before the threads write, and gzip's header carries no time: any number of
    threads writes the same files (export.json's checksums and sizes included); gzipped rows are the
    plain rows' bytes."""
    samples = make_samples(40, seed=6, lo=5, hi=60)
    shards = [tmp_path / "00000", tmp_path / "00001"]
    settings = {**SETTINGS, "dtype": "bfloat16", "compress": "zstd_planes", "shard_bytes": 6_000}
    capture_shard(samples[:25], shards[0], raw_capture, settings)
    capture_shard(samples[25:], shards[1], raw_capture, settings)
    held_out = {"s3", "s30"}
    for fmt, settings in (("specforge", GZIP), ("speculators", {})):
        runs = {}
        for threads in (1, 3):
            out = tmp_path / f"{fmt}-{threads}"
            summary = export(
                shards, out, fmt, model_path=tiny_model_dir, settings=settings, held_out=held_out, threads=threads
            )
            runs[threads] = (summary, files(out), json.loads((out / "export.json").read_text())["files"])
        (one, a, sums_a), (three, b, sums_b) = runs[1], runs[3]
        assert one["samples"] == 38 and {**one, "shards": 0, "command": 0} == {**three, "shards": 0, "command": 0}
        named = (".json", ".md", ".yaml")  # these name their own paths
        assert a.keys() == b.keys() and all(a[n] == b[n] for n in a if not n.endswith(named))
        assert {n: c for n, c in sums_a.items() if not n.endswith(named[1:])} == {
            n: c for n, c in sums_b.items() if not n.endswith(named[1:])
        }
    plain = export(shards, tmp_path / "plain", "specforge", model_path=tiny_model_dir, held_out=held_out)
    gzipped = files(tmp_path / "specforge-1")
    for name, data in files(tmp_path / "plain").items():
        if name.endswith(".ckpt"):
            assert gzip.decompress(gzipped[name + ".gz"]) == data
    assert plain["rows"]["compress"] == "none" and plain["rows"]["bytes"] == plain["rows"]["raw_bytes"]


class SteppedCapture:
    """A stand-in capture (no GPU here): its forward pass of part k waits until the writer has started
    part k - 1, so a capture that writes a part only after the next forward pass deadlocks (and times out)."""

    def __init__(self, capture):
        self.capture = capture
        self.packed, self.ranks = capture.packed, capture.ranks
        self.model_name, self.num_layers, self.hidden_size = capture.model_name, capture.num_layers, capture.hidden_size
        self.aux_layers, self.final = capture.aux_layers, capture.final
        self.forwards = 0
        self.writing: list[threading.Event] = [threading.Event() for _ in range(64)]
        self.overlapped = 0

    def __call__(self, batch):
        part = self.forwards
        self.forwards += 1
        if part > 0:
            assert self.writing[part - 1].wait(timeout=20), "the previous part was not being written"
            self.overlapped += 1
        return self.capture(batch)


def test_parts_are_written_beside_the_next_forward_passes(tmp_path, raw_capture, monkeypatch):
    samples = make_samples(12, seed=1)
    settings = {**SETTINGS, "shard_bytes": 8_000, "max_batch_tokens": 10**6, "writer_threads": 2}
    stepped = SteppedCapture(raw_capture)
    real_write = shard_module.write_part
    done_writing: list[int] = []

    def write(path, *args, seed, **kwargs):
        stepped.writing[seed].set()  # the part number is the reference rows' seed
        result = real_write(path, *args, seed=seed, **kwargs)
        done_writing.append(seed)
        return result

    monkeypatch.setattr(shard_module, "write_part", write)
    index = capture_shard(samples, tmp_path / "stepped", stepped, settings)
    parts = len(index["parts"])
    assert parts >= 3 and stepped.overlapped == parts - 1 and sorted(done_writing) == list(range(parts))
    monkeypatch.setattr(shard_module, "write_part", real_write)
    reference = capture_shard(samples, tmp_path / "one-thread", raw_capture, {**settings, "writer_threads": 1})
    assert [p["xxh3_64"] for p in index["parts"]] == [p["xxh3_64"] for p in reference["parts"]]


def test_a_writer_threads_error_fails_the_shard_and_keeps_nothing_finished(tmp_path, raw_capture, monkeypatch):
    def disk_fails(*args, **kwargs):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(shard_module, "write_part", disk_fails)
    with pytest.raises(OSError, match="Input/output error"):
        capture_shard(make_samples(6), tmp_path / "out", raw_capture, {**SETTINGS, "shard_bytes": 4_000})
    assert not (tmp_path / "out").exists()


def test_writer_threads_auto_leaves_a_core_to_each_capture_process():
    import os

    cores = len(os.sched_getaffinity(0))
    assert shard_module.writer_threads("auto", processes=1) == max(1, cores - 1)
    assert shard_module.writer_threads("auto", processes=10**3) == 1
    assert shard_module.writer_threads(5, processes=8) == 5


def test_the_plan_captures_at_the_slower_of_the_forward_passes_and_the_cpu_side():
    """The Kimi config's capture: 32 CPUs less 8 GPU ranks at zstd_planes level 1's measured rate a core keep
    up with the 40k tokens/s of the forward passes; on 16 CPUs the CPU side bounds the stage."""
    config = fill_defaults(yaml.safe_load((REPO / "config/kimi-k2.5-sglang.yaml").read_text()))
    per_token, per_core = 57_349, storage.CAPTURE_BYTES_PER_CORE_S[("plain", "zstd_planes", 1)]
    rates = capture_rates(config, per_token, config["plan"]["throughput"]["prefill_tokens_per_s"])
    assert rates["cpu_cores"] == 24 and rates["cpu_tokens_per_s"] == pytest.approx(24 * per_core / per_token)
    assert rates["bound_by"] == "gpu" and rates["tokens_per_s"] == rates["gpu_tokens_per_s"] == 40_000
    config["resources"]["jobs"]["hidden_states"]["cpus_per_task"] = 16
    slower = capture_rates(config, per_token, config["plan"]["throughput"]["prefill_tokens_per_s"])
    assert slower["bound_by"] == "cpu" and slower["tokens_per_s"] == pytest.approx(8 * per_core / per_token)


def test_the_jobs_ask_for_what_their_bytes_need(tmp_path):
    """Threads, memory and minutes from the shards' index.json: a demo-sized export asks for one thread,
    a Kimi partition's for many, gzip more than plain; nothing captured yet, the least."""
    config = fill_defaults(
        {
            "model": {"path": str(tmp_path / "no-model")},
            "plan": {"model": {"num_layers": 61, "hidden_size": 7168}},
            "hidden_states": {"aux_layers": "auto", "dtype": "bfloat16", "shard_bytes": 1 << 30},
            "tokens": {},
            "export": {"formats": ["specforge"]},
            "probe": {},
        }
    )

    def shard(name: str, tokens: int, parts: int) -> str:
        path = tmp_path / name
        path.mkdir()
        part = {"raw_bytes": tokens // parts * 57_349, "bytes": tokens // parts * 40_000}
        index = {"tokens": tokens, "samples": tokens // 3000, "parts": [part] * parts}
        (path / "index.json").write_text(json.dumps(index))
        return str(path)

    small = job_resources.export_job(config, [shard("small", 3_000, 1)], "specforge")
    assert small.threads == 1 and small.runtime == 15 + 1 and 3_000 < small.mem_mb < 5_000
    kimi = [shard(f"{n:05d}", 10_000_000, 17) for n in range(16)]  # 160M tokens: one Kimi partition
    plain = job_resources.export_job(config, kimi, "specforge")
    config["export"]["specforge"]["compress"] = "gzip"
    gzipped = job_resources.export_job(config, kimi, "specforge")
    assert 1 < plain.threads < gzipped.threads == job_resources.MAX_THREADS
    assert gzipped.mem_mb > plain.mem_mb > 10_000
    # at most a day on 64 threads of this machine's cores; 9.2 TB of states at gzip's rate a core
    assert 24 * 60 > gzipped.runtime > 9.2e12 / SPECFORGE.gzip_bytes_per_core_s / 64 / 60
    assert job_resources.export_job(config, [str(tmp_path / "not-yet")], "speculators") == job_resources.JobSize(
        1, 3_000, 15
    )
    probe = job_resources.probe_job(config, kimi[0])
    assert probe.mem_mb > 200_000 * 7168 * 2 / 1e6  # the LM head, at a large target's vocabulary
    assert probe.runtime > 10_000_000 * 57_344 / job_resources.DECODE_RATE / probe.threads / 60


def test_an_api_responses_jobs_runtime_is_its_shards_plan_and_settable(tmp_path):
    """The shipped OpenRouter config (32 API shards sharing 2,000 slots: 62.5 each): a shard of 1,000
    one-turn prompts at max_new_tokens 8192 and 20 tokens/s is 409,600 s of answers over 62.5 slots, 6,554 s,
    times 3 plus 15 minutes; the partition's observed 500 tokens per turn shorten it; api_runtime sets it; a
    partition answered by the dataset's own turns keeps resources.jobs.responses.runtime."""
    config = fill_defaults(yaml.safe_load((REPO / "config/kimi-k2.5-openrouter.yaml").read_text()))
    shard = str(prompts_file(tmp_path, 1000, name="00000.jsonl.zst"))
    results = tmp_path / "results"
    assert job_resources.responses_minutes(config, "B1_glaive", shard, results) == 15 + math.ceil(
        1000 * 8192 / 20 / (2000 / 32) * 3 / 60
    )
    assert job_resources.responses_minutes(config, "B1_glaive", str(tmp_path / "not-yet"), results) == 15
    stats = results / "B1_glaive" / "responses" / "00003.stats.json"
    stats.parent.mkdir(parents=True)
    stats.write_text(json.dumps({"assistant_turns": 40, "usage": {"completion_tokens": 20_000}}))
    assert job_resources.responses_minutes(config, "B1_glaive", shard, results) == 15 + 20
    config["resources"]["jobs"]["responses"]["api_runtime"] = 600
    assert job_resources.responses_minutes(config, "B1_glaive", shard, results) == 600
    config["partitions"]["B1_glaive"]["backend"] = "dataset"
    assert job_resources.responses_minutes(config, "B1_glaive", shard, results) == 240
