"""The disk check against quotas, a filesystem that fills, and a first run's estimate
(eagle3_datagen.workflow.disk, workflow.quota, workflow.preflight; the capture job's own check)."""

import errno
import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from eagle3_datagen.config_schema import fill_defaults
from eagle3_datagen.workflow import disk, quota
from eagle3_datagen.workflow.preflight import Job, _disk_writes, problems
from eagle3_datagen.workflow.settings import hidden_run_settings, hidden_settings, merged
from tests.helpers import REPO
from tests.unit.test_preflight import VENV_BIN, write_audits

PARTITION = "demo_sharegpt"
JOBS = [Job("hidden_states", PARTITION), Job("export", PARTITION)]


def demo_config(model: Path) -> dict:
    """The embedded demo's config, its sources and a model directory (its config.json only) found from anywhere."""
    config = fill_defaults(yaml.safe_load((REPO / "config.yaml").read_text()))
    for settings in config["partitions"].values():
        settings["source"] = str(REPO / settings["source"])
    model.mkdir(parents=True)
    (model / "config.json").write_text('{"hidden_size": 64, "num_hidden_layers": 8}')
    config["model"]["path"] = str(model)
    return config


def printed(used, mark: str, soft, hard, grace) -> str:
    """One quota's space or files as quota.c and lfs.c print them: " %7s%c %6s %7s %7s"."""
    return f" {used!s:>7}{mark} {soft!s:>6} {hard!s:>7} {grace!s:>7}"


def quota_row(fs: str, used_kib: int, soft_kib: int, hard_kib: int, over: bool = False) -> str:
    """A row as quota-tools 4.x prints it with -w -p (quota.c: "%15s", then space and files, the grace as
    epoch seconds or 0)."""
    space = printed(used_kib, "*" if over else " ", soft_kib, hard_kib, 1765000000 if over else 0)
    return f"{fs:>15}" + space + printed(12, " ", 0, 0, 0)


def heading(space: str) -> str:
    """quota.c's and lfs.c's column heading: "%15s%8s %7s%8s%8s%8s %7s%8s%8s"."""
    limits = f"{'quota':>7}{'limit':>8}{'grace':>8}"
    return f"{'Filesystem':>15}{space:>8} {limits}{'files':>8} {limits}"


QUOTA_HEADING = heading("blocks")


def stand_in_tool(directory: Path, name: str, report: str) -> Path:
    """A stand-in `quota` or `lfs` on PATH (no filesystem here enforces quotas: tmpfs is built without them
    and loop mounts are refused) that prints `report` and records its arguments."""
    directory.mkdir(parents=True, exist_ok=True)
    tool = directory / name
    (directory / f"{name}.report").write_text(report)
    tool.write_text(f'#!/bin/sh\necho "$@" >> {directory}/{name}.args\n/bin/cat {directory}/{name}.report\nexit 1\n')
    tool.chmod(tool.stat().st_mode | stat.S_IEXEC)
    return directory


def test_the_quota_tools_reports_are_read_and_the_tightest_quota_counts(tmp_path):
    """quota-tools' and Lustre's lfs layouts (their sources' printf formats); over a limit: `*`, 0 left."""
    report = "\n".join(
        [
            "Disk quotas for user alice (uid 1000): ",
            QUOTA_HEADING,
            quota_row("/dev/sdb1", 40960, 51200, 61440),
            "Disk quotas for group hpc (gid 2000): ",
            QUOTA_HEADING,
            quota_row("/dev/sdb1", 1040384, 0, 1048576),
            "Disk quotas for group students (gid 2001): none",
        ]
    )
    rows = quota.parse_report(report)
    assert [(r.title, r.left) for r in rows] == [("user alice", 10 * 2**20), ("group hpc", 8 * 2**20)]
    over = quota.parse_report(QUOTA_HEADING + "\n" + quota_row("/dev/sdb1", 70000, 51200, 61440, over=True))
    assert over[0].used == 70000 * 1024 and over[0].left == 0
    # lfs.c's print_quota: the mount on a line of its own when long, `-` grace, `[...]` where inaccurate
    lfs = "\n".join(
        [
            "Disk quotas for usr bob (uid 500):",
            heading("kbytes"),
            "/lustre/scratch/project",
            printed("[7248]", "*", 5000, 6000, "6d23h59m") + printed(40, " ", 0, 0, "-"),
        ]
    )
    assert [(r.title, r.used, r.left) for r in quota.parse_report(lfs)] == [("usr bob", 7248 * 1024, 0)]
    [user, group] = quota.quota_commands(Path("/lustre/scratch"), "10.0.0.1@o2ib:/scratch", "lustre")
    assert (user[:3], group[:3], user[-1]) == (["lfs", "quota", "-u"], ["lfs", "quota", "-g"], "/lustre/scratch")

    tools = stand_in_tool(tmp_path / "bin", "quota", report)
    mount = disk.filesystem(tmp_path)[1]
    found = quota.quota_left(mount, {"PATH": f"{tools}:{VENV_BIN}"})
    assert found == quota.QuotaLeft(8 * 2**20, f"group hpc's quota (quota -u -g -w -p -f {mount})")
    assert (tools / "quota.args").read_text() == f"-u -g -w -p -f {mount}\n"
    assert quota.quota_left(mount, {"PATH": VENV_BIN}) is None  # no tool: free space alone


MMLSQUOTA_HEADER = (
    "mmlsquota::HEADER:version:reserved:reserved:filesystemName:quotaType:id:name:blockUsage:blockQuota:"
    "blockLimit:blockInDoubt:blockGrace:filesUsage:filesQuota:filesLimit:filesInDoubt:filesGrace:remarks:quota:"
    "defQuota:fid:filesetname:"
)


def test_gpfs_quotas_are_read_from_mmlsquota_records(tmp_path, monkeypatch):
    """`mmlsquota -Y` on a GPFS mount (a stand-in printing its records: their HEADER's field names as
    IBM Storage Scale prints them; no GPFS here): the rows of that file system, the usage in doubt counted
    as used."""
    report = "\n".join(
        [
            MMLSQUOTA_HEADER,
            "mmlsquota::0:1:::gpfs0:USR:1001:alice:1048576:2097152:3145728:1024:none:1000:0:0:0:none:e:on:off:::",
            "mmlsquota::0:1:::gpfs1:USR:1001:alice:10:20:30:0:none:1:0:0:0:none:e:on:off:::",
        ]
    )
    rows = quota.parse_mmlsquota(report, "/dev/gpfs0")
    assert rows == [quota.QuotaRow("usr alice", (1048576 + 1024) * 1024, 2097152 * 1024, 3145728 * 1024)]
    assert rows[0].left == (2097152 - 1048576 - 1024) * 1024
    tools = stand_in_tool(tmp_path / "bin", "mmlsquota", report)
    monkeypatch.setattr(quota, "mounted", lambda mount: ("gpfs0", "gpfs"))
    found = quota.quota_left(Path("/gpfs/gpfs0"), {"PATH": f"{tools}:{VENV_BIN}"})
    assert found.left == rows[0].left and found.said.startswith("usr alice's quota (mmlsquota -u ")
    assert (tools / "mmlsquota.args").read_text().splitlines()[0].endswith(" -Y gpfs0")


def test_a_quota_smaller_than_the_plans_bytes_is_refused(tmp_path):
    """A stand-in `quota` report leaves 8 MiB: the demo partition's measured 20,000 tokens (shards and both
    exports) need more and the run stops; 2,000 fit. resources.disk_quota_bytes caps what results/ holds."""
    config = demo_config(tmp_path / "model")
    results = tmp_path / "results"
    report = "\n".join(
        ["Disk quotas for group hpc (gid 2000): ", QUOTA_HEADING, quota_row("/dev/sdb1", 1040384, 0, 1048576)]
    )
    env = {"PATH": f"{stand_in_tool(tmp_path / 'bin', 'quota', report)}:{VENV_BIN}"}
    write_audits(results, PARTITION, 2, tokens=20_000, samples=200)
    writes, _ = _disk_writes(config, JOBS, results)
    needed = sum(size for _, _, size in writes)
    assert 8 * 2**20 < needed < shutil.disk_usage(tmp_path).free
    mount = disk.filesystem(results)[1]
    [refused] = problems(config, JOBS, env, False, results)
    assert refused.startswith(
        f"the hidden-state shards and exports of {PARTITION} need up to {needed / 2**30:,.1f} GiB"
    )
    assert (
        f"but 0.0 GiB are left by group hpc's quota (quota -u -g -w -p -f {mount}) on the filesystem at {mount}"
        in refused
    )
    assert problems(config, JOBS, {"PATH": VENV_BIN}, False, results) == []  # free space alone: it fits
    write_audits(results, PARTITION, 2, tokens=2_000, samples=20)
    assert problems(config, JOBS, env, False, results) == []
    # a stated quota: what results/ already holds counts against it
    config["resources"]["disk_quota_bytes"] = disk.existing_bytes(results) + 1000
    [stated] = problems(config, JOBS, {"PATH": VENV_BIN}, False, results)
    assert "are left of resources.disk_quota_bytes (0.0 GiB, of which" in stated


@pytest.fixture
def small_filesystem(tmp_path):
    """A real 8 MiB tmpfs mounted for the test (root only), unmounted after."""
    where = tmp_path / "fs"
    where.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(where)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"mount -t tmpfs is not permitted here: {mounted.stderr.decode().strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=True)


def test_a_filesystem_that_fills_refuses_the_run_and_each_capture_job(tmp_path, small_filesystem):
    """On a real 8 MiB tmpfs: the preflight refuses a plan above what it holds and passes one that fits; a
    capture job whose shard fits passes until the filesystem fills, then refuses before writing anything,
    naming the path, the bytes and what is left; what it prevents is a write that fails with ENOSPC."""
    config = demo_config(tmp_path / "model")
    results = small_filesystem / "results"
    env = {"PATH": VENV_BIN}
    write_audits(results, PARTITION, 2, tokens=20_000, samples=200)
    [refused] = problems(config, JOBS, env, False, results)
    assert f"are free on the filesystem at {small_filesystem}: free space or quota there" in refused
    write_audits(results, PARTITION, 2, tokens=2_000, samples=20)
    assert problems(config, JOBS, env, False, results) == []

    settings = merged(hidden_settings(config), hidden_run_settings(config))
    tokens = results / PARTITION / "tokens" / "00000.jsonl.zst"
    out = results / PARTITION / "hidden" / "00000"
    assert disk.capture_room_problem(tokens, out, settings, env) is None  # 1,000 tokens: about 0.5 MiB
    ballast = small_filesystem / "ballast"
    with open(ballast, "wb") as f, pytest.raises(OSError) as full:
        while True:
            f.write(b"\0" * 2**16)
            f.flush()
    assert full.value.errno == errno.ENOSPC
    problem = disk.capture_room_problem(tokens, out, settings, env)
    assert problem.startswith(f"the hidden-state shard {out} needs about 0.00 GiB (1,000 tokens measured in ")
    assert f"but 0.0 GiB are free on the filesystem at {small_filesystem}: nothing was written" in problem
    # the capture job's script, with the rule's settings and the workflow's run settings, refuses to start
    job = subprocess.run(
        [
            sys.executable,
            str(REPO / "scripts/hidden_states.py"),
            *("--tokens", str(tokens), "--out", str(out)),
            *("--settings", json.dumps(hidden_settings(config))),
            *("--run-settings", json.dumps(hidden_run_settings(config))),
        ],
        capture_output=True,
        text=True,
    )
    assert job.returncode == 2
    assert job.stderr.splitlines()[-1].startswith(f"error: [Errno {errno.EDQUOT}] the hidden-state shard {out} needs")
    assert not out.exists()
    ballast.unlink()
    assert disk.capture_room_problem(tokens, out, settings, env) is None


def test_a_first_run_without_prompts_is_estimated_from_the_sources_records(tmp_path):
    """No prompts yet: each source record is a sample of its JSON bytes / 3 tokens, the template's 64 and one
    turn's 48 new tokens (its dataset twin: no new tokens), at most max_length; max_prompts counts only the
    first records. A stated quota below the estimate is refused."""
    config = demo_config(tmp_path / "model")
    records = [line for line in (REPO / "resources/demo/data/sharegpt.jsonl").read_text().splitlines() if line.strip()]
    estimate = disk.estimated_tokens(config, PARTITION)
    assert (estimate.samples, estimate.tokens) == (27, 4958)
    assert estimate.basis == "estimate (source records, max tokens per turn)"
    assert disk.estimated_tokens(config, PARTITION + "+original").tokens == 4958 - 48 * len(records)
    config["partitions"][PARTITION]["max_prompts"] = 5
    assert disk.estimated_tokens(config, PARTITION).samples == 5
    config["tokens"]["max_length"] = 100
    assert disk.estimated_tokens(config, PARTITION).tokens == 500
    config["partitions"][PARTITION].pop("max_prompts")
    config["tokens"]["max_length"] = 2048

    results = tmp_path / "results"
    writes, bases = _disk_writes(config, JOBS, results)
    assert bases == {"estimate (source records, max tokens per turn)"}
    needed = sum(size for _, _, size in writes)
    counted = disk.partition_bytes(config, PARTITION, estimate, results)
    assert needed == counted.shards // 2 * 2 + sum(counted.exports.values())
    config["resources"]["disk_quota_bytes"] = needed - 1
    [refused] = problems(config, JOBS, {"PATH": VENV_BIN}, False, results)
    assert "(estimate (source records, max tokens per turn)), but" in refused and "--until tokens" in refused
    config["resources"]["disk_quota_bytes"] = needed
    assert problems(config, JOBS, {"PATH": VENV_BIN}, False, results) == []


def test_before_the_tokens_exist_the_responses_usage_counts(tmp_path):
    """An answer the model gave counts its usage (prompt and completion tokens); the `dataset` twin's record
    answers are estimated (3 bytes a token, the template's 64); a failed row counts nothing. Where the
    responses rerun, the stage above them counts instead: the prompts' bound, or where those rerun too (or
    do not exist) the sources' estimate."""
    from eagle3_datagen.formats.files import write_jsonl_zst

    config = demo_config(tmp_path / "model")
    results = tmp_path / "results"
    answered = {"role": "assistant", "content": "Paris.", "usage": {"prompt_tokens": 31, "completion_tokens": 8}}
    user = {"role": "user", "content": "What is the capital of France?"}
    rows = [
        {"id": "a", "messages": [user, answered], "status": "ok"},
        {"id": "b", "messages": [user, {**answered, "usage": {"prompt_tokens": 3000, "completion_tokens": 48}}]},
        {"id": "c", "messages": [user], "status": "failed", "error": "refused"},
    ]
    for shard, shard_rows in (("00000", rows), ("00001", [])):
        write_jsonl_zst(results / PARTITION / "responses" / f"{shard}.jsonl.zst", shard_rows)
    counted = disk.responded_tokens(config, PARTITION, results)
    assert (counted.tokens, counted.samples, counted.basis) == (39 + 2048, 2, "counted (responses' usage)")
    own = {"role": "assistant", "content": "Paris."}
    write_jsonl_zst(results / f"{PARTITION}+original/responses/00000.jsonl.zst", [{"id": "a", "messages": [user, own]}])
    write_jsonl_zst(results / f"{PARTITION}+original/responses/00001.jsonl.zst", [])
    text = len(b'{"role":"user","content":"What is the capital of France?"}{"role":"assistant","content":"Paris."}')
    assert disk.responded_tokens(config, PARTITION + "+original", results).tokens == -(-text // 3) + 64
    _, bases = _disk_writes(config, JOBS, results)
    assert bases == {"counted (responses' usage)"}
    _, bases = _disk_writes(config, [Job("responses", PARTITION), *JOBS], results)
    assert bases == {"estimate (source records, max tokens per turn)"}  # no prompts here: the sources
    write_jsonl_zst(results / PARTITION / "prompts/00000.jsonl.zst", [{"id": "a", "messages": [user]}])
    write_jsonl_zst(results / PARTITION / "prompts/00001.jsonl.zst", [])
    _, bases = _disk_writes(config, [Job("responses", PARTITION), *JOBS], results)
    assert bases == {"upper bound (prompts, max tokens per turn)"}
    _, bases = _disk_writes(
        config, [Job(f"prompts_{PARTITION}", PARTITION), Job("responses", PARTITION), *JOBS], results
    )
    assert bases == {"estimate (source records, max tokens per turn)"}  # the prompts rerun too: the sources
