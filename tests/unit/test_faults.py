"""Faults of a long run, injected for real: a filesystem that fills while a hidden-state part, a
responses journal line or an export is written.

The full filesystem is a real tmpfs the test mounts as root (skipped, with the reason, where the
machine refuses the mount), filled to a few KiB by a filler file; deleting the filler is "space
freed". The hidden-state jobs and their capture runner are the real scripts and runner (`hf`, a tiny
Qwen3). The responses job is the real `scripts/responses.py`; the HTTP server it talks to is the
loopback double (tests/doubles), since the fault is the disk's, not the server's.
"""

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from eagle3_datagen.backends.hf.capture import HFCapture
from eagle3_datagen.backends.service.record import running_record
from eagle3_datagen.formats.files import read_jsonl, write_jsonl_zst
from eagle3_datagen.formats.hidden_shard import HiddenShard
from eagle3_datagen.formats.journal import journal_path
from eagle3_datagen.stages.export import export
from eagle3_datagen.stages.hidden.shard import capture_shard
from tests.doubles.loopback import FaultPlan, Loopback, serve_in_thread
from tests.helpers import HIDDEN_SETTINGS as SETTINGS
from tests.helpers import (
    KEY_ENV,
    REPO,
    SAMPLING,
    defaults,
    hidden_job,
    make_samples,
    prompts_file,
    runner_job_settings,
    runner_log,
    wait_until,
)

pytestmark = pytest.mark.mount


class SmallDisk:
    """A real tmpfs at `path`, mounted by the test: `fill(left)` leaves about `left` bytes free, `free()`
    gives the space back."""

    def __init__(self, path: Path, size: str):
        self.path = path
        self.filler = path / "filler"
        path.mkdir()
        mounted = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True, text=True
        )
        if mounted.returncode != 0:
            pytest.skip(f"mounting a tmpfs was refused ({mounted.stderr.strip() or mounted.returncode}): needs root")

    def fill(self, left: int) -> None:
        with open(self.filler, "ab") as f:
            f.write(b"\0" * (os.statvfs(self.path).f_bavail * os.statvfs(self.path).f_frsize - left))

    def free(self) -> None:
        self.filler.unlink()

    def unmount(self) -> None:
        subprocess.run(["umount", "--lazy", str(self.path)], check=True)


@pytest.fixture
def disk(tmp_path):
    small = SmallDisk(tmp_path / "disk", "4m")
    yield small
    small.unmount()


def full_disk_said(text: str, path: Path, disk: SmallDisk) -> bool:
    """Whether `text` names the full disk: the path written, the space left, the filesystem and the fix."""
    said = rf"No space left on device writing {re.escape(str(path))}: [\d.]+ (bytes|KiB) free of 4\.0 MiB"
    said += rf" on the filesystem at {re.escape(str(disk.path))}\. Free space there"
    return re.search(said, text) is not None


def test_a_full_disk_during_capture_fails_the_job_saying_so_and_the_rerun_keeps_the_parts(
    tmp_path, node, disk, tiny_model_dir
):
    samples = make_samples(200, seed=3)
    write_jsonl_zst(tmp_path / "t.jsonl.zst", samples)
    out = disk.path / "out"
    job_settings = runner_job_settings(tiny_model_dir, shard_bytes=20_000)
    disk.fill(left=150_000)
    assert hidden_job(tmp_path, tmp_path / "t.jsonl.zst", out, job_settings).wait() == 2
    job_log = Path(f"{out}.log").read_text()
    assert full_disk_said(job_log, out, disk), job_log
    assert "Traceback" not in job_log  # the cause and the fix
    assert "error: [Errno 28] No space left on device writing" in runner_log(tmp_path)
    assert not out.exists()  # nothing half-written looks finished
    kept = sorted((disk.path / ".out.partial").glob("part-*.xxh3_64"))  # the parts written whole
    assert len(kept) >= 3
    # The runner stopped after the failed shard: no service left running.
    assert wait_until(lambda: running_record(node) is None, timeout=30)

    disk.free()
    assert hidden_job(tmp_path, tmp_path / "t.jsonl.zst", out, job_settings).wait() == 0
    log = runner_log(tmp_path)
    assert log.count("complete from an earlier run, kept") == len(kept)  # each checksum verified, none redone
    torch.set_num_threads(1)  # as the runner: --threads 1
    capture = HFCapture(tiny_model_dir, "auto", "raw", defaults("hidden_states.hf", dtype="float32"))
    reference = capture_shard(samples, tmp_path / "ref", capture, job_settings["hidden_states"])
    written = json.loads((out / "index.json").read_text())
    assert written["parts"] == reference["parts"]  # the same bytes as an uninterrupted capture
    assert HiddenShard(out).ids == [s["id"] for s in samples]
    parts = len(written["parts"])
    print(f"\ncapture on a full disk: parts kept {len(kept)} of {parts}, recomputed {parts - len(kept)}")


def test_a_full_disk_during_the_responses_journal_loses_no_prompt(tmp_path, disk, qwen_tokenizer):
    qwen_tokenizer.save_pretrained(tmp_path / "model")
    prompts = prompts_file(tmp_path, 40)
    server = Loopback("unused", api_key="test-key", faults=FaultPlan(latency_s=0.02))
    job_settings = {
        "backend": "openrouter",
        "max_failed_rate": 0.0,
        "sampling": SAMPLING,
        "openrouter": defaults("inference.openrouter", base_url=None, model="m", api_key_env=KEY_ENV, concurrency=2),
        "model": defaults("model", path=str(tmp_path / "model")),
    }
    out = disk.path / "out.jsonl.zst"
    disk.fill(left=6_000)  # a page for the journal's first lines, then full
    with serve_in_thread(server) as url:
        job_settings["openrouter"]["base_url"] = url
        command = [sys.executable, str(REPO / "scripts/responses.py"), "--prompts", str(prompts), "--out", str(out),
                   "--stats", str(tmp_path / "stats.json"), "--settings", json.dumps(job_settings)]  # fmt: skip
        env = {**os.environ, KEY_ENV: "test-key"}
        failed = subprocess.run(command, env=env, capture_output=True, text=True)
        assert failed.returncode == 2
        assert full_disk_said(failed.stderr, out, disk), failed.stderr
        assert not out.exists()
        journaled = [json.loads(line)["id"] for line in journal_path(out).read_bytes().split(b"\n")[1:-1]]
        assert 0 < len(journaled) < 40
        disk.free()
        started = time.monotonic()
        subprocess.run(command, env=env, check=True, capture_output=True)
        rerun_s = time.monotonic() - started
    rows = read_jsonl(out)
    assert [r["id"] for r in rows] == [f"id{i:04d}" for i in range(40)] and all(r["status"] == "ok" for r in rows)
    repeated = sum(server.completed.values()) - 40
    assert max(server.completed.values()) <= 2 and repeated <= 2  # only requests in flight (concurrency 2)
    print(f"journaled before the disk filled: {len(journaled)}, repeated: {repeated}, rerun {rerun_s:.1f} s")


def test_a_full_disk_during_export_leaves_no_export_and_the_rerun_writes_it_whole(tmp_path, disk, tiny_model_dir):
    capture = HFCapture(tiny_model_dir, "auto", "raw", defaults("hidden_states.hf", dtype="float32"))
    capture_shard(make_samples(12, seed=4), tmp_path / "00000", capture, {**SETTINGS, "shard_bytes": 8_000})
    out = disk.path / "speculators"
    command = [sys.executable, str(REPO / "scripts/export.py"), "--format", "speculators",
               "--hidden", str(tmp_path / "00000"), "--out", str(out), "--model", str(tiny_model_dir)]  # fmt: skip
    disk.fill(left=20_000)
    failed = subprocess.run(command, capture_output=True, text=True)
    assert failed.returncode == 2
    assert full_disk_said(failed.stderr, out, disk), failed.stderr
    assert not out.exists() and not list(disk.path.glob(".speculators.*"))  # no half export, no leftovers
    disk.free()
    subprocess.run(command, check=True, capture_output=True)
    export([tmp_path / "00000"], tmp_path / "ref", "speculators", model_path=tiny_model_dir)
    written = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    reference = {p.relative_to(tmp_path / "ref"): p.read_bytes() for p in (tmp_path / "ref").rglob("*") if p.is_file()}
    assert written.keys() == reference.keys() and len(written) > 2
    # the same bytes as an export to a roomy disk (the README's commands and the json files name the paths)
    same = [name for name in written if name.suffix not in (".json", ".md")]
    assert len(same) == 14 and all(written[name] == reference[name] for name in same)
