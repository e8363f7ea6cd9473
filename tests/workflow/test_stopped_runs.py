"""Stopped runs: the real workflow (the demo's real capture runner as the node service) signalled while
the runner is up, then rerun: locally (`--profile profiles/local`) and on the SLURM test cluster
(`--profile profiles/slurm`, tests/slurm).

Each test starts from a copy of the finished demo (`demo_dir`) without demo_sharegpt's hidden-state
shards and what is made of them, so the run captures them again through the node's runner, and the
stop comes once the runner is ready and the first shard's job has handed it its request. The outputs
after the rerun are compared with the uninterrupted demo's: every hidden-state part, the exports and
the draft vocabulary byte for byte (less the working directory the exports' README and yaml files
name, and those files' checksums); each shard's index.json and probe report without their wall-clock
fields (`without_timings`: throughput and seconds differ between any two runs). results/report (the
summaries, with timings) is not compared, nor are the evaluate stage's drafts: the local rerun leaves
out the evaluate jobs, the data curve's points and the summary page that reads them (`--omit-from`),
which would train drafts for the partition and for all partitions again (two more for each point), most
of a rerun's time. The SLURM tests run the
hidden-state shards only and compare those.
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from eagle3_datagen.backends.service import record as service_record
from tests.helpers import wait_until
from tests.slurm import JOB_SIZE, SLURM_ARGS, sacct_jobs, without_timings

pytestmark = pytest.mark.e2e

PARTITION = "demo_sharegpt"
HIDDEN = f"results/{PARTITION}/hidden"
# The rules whose outputs no comparison reads (the drafts the evaluate stage trains, the data curve's among
# them), left out of reruns.
UNCOMPARED = ["evaluate", "evaluate_all", "evaluate_point", "evaluate_point_all"]


def stoppable_copy(demo_dir: Path, work: Path) -> dict:
    """A copy of the finished demo without PARTITION's hidden states and what is made of them (Snakemake
    reruns no job for a missing file that no missing output needs), and the environment its runs take
    (a node directory of its own under `work`)."""
    shutil.copytree(demo_dir, work, symlinks=True)
    for made in [*(work / HIDDEN).iterdir(), *(work / f"results/{PARTITION}/export").iterdir()]:
        shutil.rmtree(made)
    for made in [*(work / f"results/{PARTITION}/probe").iterdir(), work / f"results/report/{PARTITION}.json"]:
        made.unlink()
    (work / "tmp").mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    return env | {"TMPDIR": str(work / "tmp"), "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}


def node_of(work: Path) -> Path:
    return work / "tmp" / f"eagle3-datagen-{os.getuid()}"


def capture_requested(node: Path) -> bool:
    """Whether the runner is ready (its record says when it became so) and a hidden-state job has handed
    it a shard."""
    record = service_record.read_record(node)
    return bool(record and record.get("ready_s") is not None) and any((node / "requests").glob("*.request.json"))


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def stop_mid_capture(work: Path, env: dict, signum: int, to_group: bool) -> dict:
    """Run the workflow in `work`, send `signum` once a shard is in the runner's hands (to Snakemake's
    process group, as Ctrl-C in a terminal does, or to Snakemake alone), and time until Snakemake, its
    jobs (the rest of its process group), the supervisor and the runner are gone."""
    node = node_of(work)
    with open(work / "stopped.log", "w") as out:
        # SIGINT as in a terminal: a shell that started pytest in the background (`cmd &`) left it ignored,
        # which its children inherit (and Python then installs no KeyboardInterrupt handler)
        run = subprocess.Popen(
            [str(Path(sys.executable).parent / "snakemake"), "--profile", "profiles/local"],
            cwd=work, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )  # fmt: skip
        try:
            assert wait_until(lambda: capture_requested(node) or run.poll() is not None, timeout=600, interval=0.05)
            assert run.poll() is None, (work / "stopped.log").read_text()
            record = json.loads((node / service_record.RECORD).read_text())
            (os.killpg if to_group else os.kill)(run.pid, signum)
            signalled = time.monotonic()
            gone = {}
            watched = {
                "snakemake": lambda: run.poll() is not None,
                "jobs": lambda: not group_alive(run.pid),
                "supervisor": lambda: not service_record.pid_alive(record["pid"]),
                "runner": lambda: not group_alive(record["service_pid"]),
            }
            while len(gone) < len(watched) and time.monotonic() - signalled < 120:
                for name, ended in watched.items():
                    if name not in gone and ended():
                        gone[name] = round(time.monotonic() - signalled, 1)
                time.sleep(0.05)
        finally:
            if group_alive(run.pid):
                os.killpg(run.pid, signal.SIGKILL)
            run.wait()
    assert gone.keys() == watched.keys(), f"still running 120 s after the signal: {watched.keys() - gone.keys()}"
    return {"returncode": run.returncode, "gone_after_s": gone, "log": (work / "stopped.log").read_text()}


def without_roots(text: str, roots) -> str:
    for root in roots:
        text = text.replace(str(root), "WORK")
    return text


def without_named_paths(value):
    """An export.json value without the checksums of the files that name paths (README.md, *.yaml)."""
    if isinstance(value, dict):
        return {k: v for k, v in value.items() if not k.endswith((".md", ".yaml"))}
    return value


def compared_outputs(work: Path, *roots: Path) -> dict[str, object]:
    """What two runs of the demo agree on (see the module's docstring), by path. The exports' README and
    yaml files name the working directory they were made in (`roots`: a copy's exports may be the
    original's), which is taken out, and export.json their checksums, which are left out."""
    outputs = {}
    for path in sorted((work / "results").rglob("*")):
        name = str(path.relative_to(work))
        if not path.is_file() or name.startswith("results/report/"):
            continue
        if name.startswith(HIDDEN) and path.suffix == ".json" or "/probe/" in name:
            outputs[name] = without_timings(json.loads(path.read_text()))
        elif name.endswith("/export.json"):
            written = json.loads(without_roots(path.read_text(), roots))
            # its bytes count the README and yaml files, whose size depends on the root's
            outputs[name] = {k: without_named_paths(v) for k, v in written.items() if k != "bytes"}
        elif "/export/" in name and path.suffix in (".md", ".yaml"):
            outputs[name] = without_roots(path.read_text(), roots)
        elif "/export/" in name or name.startswith(HIDDEN) or name.startswith("results/vocab"):
            outputs[name] = path.read_bytes()
    return outputs


def rerun_and_compare(work: Path, env: dict, demo_dir: Path, kept: list[str]) -> float:
    """Rerun the stopped run, less the evaluate jobs (see the module's docstring); it captures only the
    shards the stop left unfinished (`kept` are not redone) and its outputs equal the uninterrupted
    demo's. Returns the rerun's seconds."""
    started = time.monotonic()
    rerun = subprocess.run(
        [str(Path(sys.executable).parent / "snakemake"), "--profile", "profiles/local", "--omit-from", *UNCOMPARED],
        cwd=work, env=env, capture_output=True, text=True,
    )  # fmt: skip
    assert rerun.returncode == 0, rerun.stdout[-4000:] + rerun.stderr[-4000:]
    captured = re.findall(rf"output: ({HIDDEN}/\d{{5}})\n", rerun.stdout + rerun.stderr)
    shards = sorted(str(p.relative_to(demo_dir)) for p in (demo_dir / HIDDEN).glob("[0-9]*"))
    assert sorted(captured) == sorted(set(shards) - set(kept))
    assert compared_outputs(work, work, demo_dir) == compared_outputs(demo_dir, demo_dir)
    return time.monotonic() - started


def left_behind(work: Path) -> list[str]:
    """What a stopped run left that could block or mislead its rerun: the runner's record,
    a registered job, a request the runner could still take (a job killed by SIGTERM leaves its
    request file, which no runner takes: its pid is dead), a shard directory without its index (one
    that looks finished but is not)."""
    node = node_of(work)
    found = [service_record.RECORD] if (node / service_record.RECORD).exists() else []
    found += [str(p) for p in node.glob("users/*")]
    requests = [json.loads(p.read_text()) for p in node.glob("requests/*.request.json")]
    found += [r["id"] for r in requests if service_record.pid_alive(r["pid"])]
    return found + [str(p) for p in (work / HIDDEN).glob("[0-9]*") if not (p / "index.json").exists()]


# Ctrl-C in a terminal signals the foreground process group: Snakemake and its jobs' processes (the node
# service runs in a session of its own). A SIGTERM that must end the run now is sent to the group too
# (`kill -TERM -- -PGID`; coreutils' `timeout` does that): Snakemake alone takes SIGTERM as "finish the
# running jobs, start no new ones", and its local executor does not stop running jobs on SIGINT either.
@pytest.mark.parametrize(
    ("signum", "to_group"),
    [(signal.SIGINT, True), (signal.SIGTERM, True), (signal.SIGTERM, False)],
    ids=["ctrl-c", "sigterm-to-the-group", "sigterm-to-snakemake"],
)
def test_a_stopped_run_ends_its_jobs_and_runner_and_the_rerun_equals_an_uninterrupted_run(
    demo_dir, tmp_path, signum, to_group
):
    work = tmp_path / "wf"
    env = stoppable_copy(demo_dir, work)
    stopped = stop_mid_capture(work, env, signum, to_group)
    assert stopped["returncode"] != 0
    assert max(stopped["gone_after_s"].values()) < 30, stopped["gone_after_s"]
    assert left_behind(work) == []
    kept = [str(p.relative_to(work)) for p in (work / HIDDEN).glob("[0-9]*")]
    rerun_s = rerun_and_compare(work, env, demo_dir, kept)
    assert wait_until(lambda: not (node_of(work) / service_record.RECORD).exists(), timeout=60)
    name = signal.Signals(signum).name
    print(
        f"\n{name} to {'the group' if to_group else 'Snakemake'}: gone after {stopped['gone_after_s']} s, "
        f"shards finished before the stop {len(kept)}, rerun {rerun_s:.0f} s"
    )


def slurm_node_dir(work: Path) -> Path | None:
    """The node directory of the allocation whose runner has a shard in hand, if any yet."""
    return next((d for d in (work / "tmp").glob("eagle3-datagen-*-slurm*") if capture_requested(d)), None)


def sacct_state(job: str) -> str:
    return sacct_jobs(job)[0]["state"] if sacct_jobs(job) else "UNKNOWN"


def past_time_limit(job: str, record: dict) -> float:
    """Stall the capture (the runner stopped with SIGSTOP holds the job's shard and never answers) and
    give the job a 1-minute time limit: SLURM ends it (SIGTERM to every step, SIGKILL KillWait later).
    Returns the seconds until the limit."""
    os.killpg(record["service_pid"], signal.SIGSTOP)
    elapsed = int(subprocess.run(["sacct", "-j", job, "-X", "-n", "-o", "ElapsedRaw"], capture_output=True,
                                 text=True, check=True).stdout.split()[0])  # fmt: skip
    subprocess.run(["scontrol", "update", f"JobId={job}", "TimeLimit=1"], check=True)
    return 60 - elapsed


def at_once(*command: str):
    """A stop that `command JOB` makes at once (0 s until it takes effect)."""

    def stop(job: str, _record: dict) -> float:
        subprocess.run([*command, job], check=True)
        return 0.0

    return stop


SLURM_STOPS = {
    # SIGTERM to the job's steps (scancel signals the batch step only with --batch or --full).
    "scancel": at_once("scancel", "--signal=TERM"),
    "requeue": at_once("scontrol", "requeue"),
    "time-limit": past_time_limit,
}


def slurm_capture_run(demo_dir: Path, work: Path, job_size: dict) -> tuple[dict, list[str]]:
    """A stoppable copy of the demo that captures its shards on the SLURM test cluster: its environment and
    the command (the hidden-state shards as targets, the profile's retries and requeue)."""
    env = stoppable_copy(demo_dir, work)
    config = yaml.safe_load((work / "config.yaml").read_text())
    resources = {"jobs": {"hidden_states": job_size, "responses_served": job_size}}
    (work / "slurm.yaml").write_text(yaml.safe_dump({**config, "resources": resources}))
    targets = [f"{HIDDEN}/{shard.name}" for shard in sorted((demo_dir / HIDDEN).glob("[0-9]*"))]
    return env, [str(Path(sys.executable).parent / "snakemake"), *targets, *SLURM_ARGS, "--configfile", "slurm.yaml"]


def hidden_outputs(work: Path) -> dict:
    return {k: v for k, v in compared_outputs(work, work).items() if k.startswith(HIDDEN)}


@pytest.mark.parametrize("stop", list(SLURM_STOPS))
def test_a_stopped_slurm_job_ends_its_runner_and_is_retried_or_requeued_to_an_uninterrupted_runs_outputs(
    demo_dir, slurm_cluster, tmp_path, stop
):
    """The capture group job (both shards, one allocation) stopped with `scancel --signal=TERM`, requeued
    with `scontrol requeue`, or run past its time limit (its capture stalled, so that it outlasts
    slurmctld's periodic check: the demo's shards take seconds). The profile's retries submit a cancelled
    or timed-out group job again, SLURM runs a requeued one again (the same job): the run completes, no
    rerun needed."""
    work = tmp_path / "wf"
    env, command = slurm_capture_run(demo_dir, work, JOB_SIZE)
    before = {j["id"] for j in sacct_jobs()}
    with open(work / "stopped.log", "w") as out:
        run = subprocess.Popen(command, cwd=work, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            # a demo shard's capture takes a fraction of a second: look often enough not to miss both
            seen = []  # the directory as first seen: its request may be done by the next look
            assert wait_until(lambda: seen.append(slurm_node_dir(work)) or seen[-1] or run.poll() is not None,
                              timeout=600, interval=0.01)  # fmt: skip
            node = seen[-1]
            assert node is not None, (work / "stopped.log").read_text()
            job = node.name.rpartition("-slurm")[2]
            record = json.loads((node / service_record.RECORD).read_text())
            signalled = time.monotonic() + SLURM_STOPS[stop](job, record)  # when the job is past its limit
            assert wait_until(lambda: not service_record.pid_alive(record["pid"]), timeout=300, interval=0.1)
            runner_gone_s = time.monotonic() - signalled
            states = set()
            assert wait_until(lambda: states.add(sacct_state(job)) or run.poll() is not None, timeout=900, interval=1)
        finally:
            if group_alive(run.pid):
                os.killpg(run.pid, signal.SIGKILL)
            run.wait()
    steps = sacct_jobs(job, steps=True)
    # slurmctld checks time limits every 30 s; then KillWait (10 s: tests/slurm/cluster.sh) before SIGKILL
    assert runner_gone_s < (90 if stop == "time-limit" else 30)
    # scancel and the time limit fail the job, which Snakemake submits again (a second job); a requeued
    # job runs again under its own id; either way the run completes.
    submitted = [j for j in sacct_jobs() if j["id"] not in before]
    assert run.returncode == 0, (work / "stopped.log").read_text()[-4000:]
    assert "REQUEUED" in states and len(submitted) == 1 if stop == "requeue" else len(submitted) == 2, submitted
    assert hidden_outputs(work) == hidden_outputs(demo_dir)
    print(
        f"\n{stop}: runner gone after {runner_gone_s:.1f} s; job states seen {sorted(states)}; "
        f"steps {[(s['id'], s['name'], s['state']) for s in steps]}; jobs {[(j['id'], j['state']) for j in submitted]}"
    )


def test_a_restarted_controller_never_runs_a_shard_twice_at_once(demo_dir, slurm_cluster, tmp_path):
    """The controller killed with SIGKILL while its capture group job runs (its runner stalled with a shard
    in hand), then restarted (`--unlock`, the same command): it submits the group again, whose job for that
    shard waits on the first copy's lease instead of capturing beside it, and ends once the first copy made
    the shard. One CPU per job: both allocations fit the test cluster's node at once, as on four nodes."""
    work = tmp_path / "wf"
    env, command = slurm_capture_run(demo_dir, work, {**JOB_SIZE, "cpus_per_task": 1})
    with open(work / "first.log", "w") as out:
        first = subprocess.Popen(
            command, cwd=work, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    second = None
    try:
        assert wait_until(lambda: slurm_node_dir(work) or first.poll() is not None, timeout=600, interval=0.1)
        node = slurm_node_dir(work)
        assert node is not None, (work / "first.log").read_text()
        record = json.loads((node / service_record.RECORD).read_text())
        (request,) = [json.loads(p.read_text()) for p in node.glob("requests/*.request.json")]
        shard = Path(request["out"]).relative_to(work.resolve())
        # the first copy holds the shard while its controller dies
        os.killpg(record["service_pid"], signal.SIGSTOP)
        first.kill()  # the controller alone: its SLURM job runs on
        first.wait()
        first_job = node.name.rpartition("-slurm")[2]
        assert sacct_state(first_job) == "RUNNING"
        subprocess.run([*command, "--unlock"], cwd=work, env=env, check=True, capture_output=True)
        with open(work / "second.log", "w") as out:
            second = subprocess.Popen(
                command, cwd=work, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        shard_log = work / f"logs/{PARTITION}/hidden/{shard.name}.log"
        waiting = "is being made by another copy of this job (SLURM job " + first_job
        assert wait_until(lambda: waiting in shard_log.read_text(errors="replace") if shard_log.exists() else False,
                          timeout=600, interval=0.5), (work / "second.log").read_text()  # fmt: skip
        assert not (work / shard).exists()  # nothing written beside the first copy
        os.killpg(record["service_pid"], signal.SIGCONT)
        assert second.wait(timeout=600) == 0, (work / "second.log").read_text()[-4000:]
        assert wait_until(lambda: sacct_state(first_job) not in ("RUNNING", "PENDING"), timeout=300, interval=1)
    finally:
        for run in (first, second):
            if run is not None and group_alive(run.pid):
                os.killpg(run.pid, signal.SIGKILL)
    assert "nothing left to do" in shard_log.read_text()
    assert hidden_outputs(work) == hidden_outputs(demo_dir)
    print(f"\nrestart: {shard} made by the first copy (SLURM job {first_job}); the second waited and ended")
