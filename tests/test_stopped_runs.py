"""Stopped runs: the real workflow (`snakemake --profile profiles/local`, the demo's real capture runner
as the node service) signalled while the runner is up, then rerun.

Each test starts from a copy of the finished demo (`demo_dir`) without demo_sharegpt's hidden-state
shards, so the run captures them again through the node's runner, and the signal arrives once the
runner is ready and the first shard's job has handed it its request. The rerun's outputs are compared
with the uninterrupted demo's: every hidden-state part, the exports and the draft vocabulary byte for
byte; each shard's index.json and probe report without their wall-clock fields (`without_timings`:
throughput and seconds differ between any two runs). The summary and the report hold timings only
and are not compared.
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

from eagle3_datagen.backends import node_service

from .conftest import wait_until
from .slurm import without_timings

PARTITION = "demo_sharegpt"
HIDDEN = f"results/{PARTITION}/hidden"


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
    """Whether the runner is ready and a hidden-state job has handed it a shard."""
    return (node / node_service.READY).exists() and any((node / "requests").glob("*.request.json"))


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
        run = subprocess.Popen(
            [str(Path(sys.executable).parent / "snakemake"), "--profile", "profiles/local"],
            cwd=work, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        try:
            assert wait_until(lambda: capture_requested(node) or run.poll() is not None, timeout=600, interval=0.05)
            assert run.poll() is None, (work / "stopped.log").read_text()
            record = json.loads((node / node_service.RECORD).read_text())
            (os.killpg if to_group else os.kill)(run.pid, signum)
            signalled = time.monotonic()
            gone = {}
            watched = {
                "snakemake": lambda: run.poll() is not None,
                "jobs": lambda: not group_alive(run.pid),
                "supervisor": lambda: not node_service.pid_alive(record["pid"]),
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
            outputs[name] = {k: without_named_paths(v) for k, v in written.items()}
        elif "/export/" in name and path.suffix in (".md", ".yaml"):
            outputs[name] = without_roots(path.read_text(), roots)
        elif "/export/" in name or name.startswith(HIDDEN) or name.startswith("results/vocab"):
            outputs[name] = path.read_bytes()
    return outputs


def rerun_and_compare(work: Path, env: dict, demo_dir: Path, kept: list[str]) -> float:
    """Rerun the stopped run; it captures only the shards the stop left unfinished (`kept` are not
    redone) and its outputs equal the uninterrupted demo's. Returns the rerun's seconds."""
    started = time.monotonic()
    rerun = subprocess.run(
        [str(Path(sys.executable).parent / "snakemake"), "--profile", "profiles/local"],
        cwd=work, env=env, capture_output=True, text=True,
    )  # fmt: skip
    assert rerun.returncode == 0, rerun.stdout[-4000:] + rerun.stderr[-4000:]
    captured = re.findall(rf"output: ({HIDDEN}/\d{{5}})\n", rerun.stdout + rerun.stderr)
    shards = sorted(str(p.relative_to(demo_dir)) for p in (demo_dir / HIDDEN).iterdir())
    assert sorted(captured) == sorted(set(shards) - set(kept))
    assert compared_outputs(work, work, demo_dir) == compared_outputs(demo_dir, demo_dir)
    return time.monotonic() - started


def left_behind(work: Path) -> list[str]:
    """What a stopped run left that could block or mislead its rerun: the runner's record or ready
    mark, a registered job, a request the runner could still take (a job killed by SIGTERM leaves its
    request file, which no runner takes: its pid is dead), a shard directory without its index (one
    that looks finished but is not)."""
    node = node_of(work)
    found = [n for n in (node_service.RECORD, node_service.READY) if (node / n).exists()]
    found += [str(p) for p in node.glob("users/*")]
    requests = [json.loads(p.read_text()) for p in node.glob("requests/*.request.json")]
    found += [r["id"] for r in requests if node_service.pid_alive(r["pid"])]
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
    assert wait_until(lambda: not (node_of(work) / node_service.RECORD).exists(), timeout=60)
    name = signal.Signals(signum).name
    print(
        f"\n{name} to {'the group' if to_group else 'Snakemake'}: gone after {stopped['gone_after_s']} s, "
        f"shards finished before the stop {len(kept)}, rerun {rerun_s:.0f} s"
    )
