"""The node's capture runner: the target model loaded once, capturing every shard its node's
hidden-state jobs send it.

Each shard is still its own job, output and resume. The runner is a node service
(`backends.service`: started by the first job on the node, stopped when no job uses it): with
the `sglang` backend, SGLang's model runner under torchrun, one rank per GPU, ranks kept alive
between shards; with `hf`, one transformers process.

A job hands over its shard as a request file (`requests/<id>.request.json`: tokens, output directory,
settings, the job's pid) in the node directory. Rank 0 takes the oldest request whose job is alive
and broadcasts it; every rank captures it in lockstep (`shard.capture_shard`); rank 0 writes the
shard's log to `requests/<id>.log`, which the job copies into its own log, and the outcome to
`requests/<id>.done.json`. A job that is gone (kill -9, cancelled by Snakemake) cancels its shard at
the next part: the complete parts stay for the rerun. An error in a shard fails its job and stops
the runner (its ranks may be out of step); the next job loads a fresh one.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import time
import traceback
from pathlib import Path

from eagle3_datagen.backends.base import CaptureBackend, ServerError
from eagle3_datagen.backends.plugins import CAPTURE
from eagle3_datagen.backends.service import Service
from eagle3_datagen.backends.service.lease import Lease, using
from eagle3_datagen.backends.service.record import SERVICE_DIR_ENV, mark_loaded, pid_alive
from eagle3_datagen.formats.files import DiskFull, read_json, read_jsonl, reporting_full_disk, write_json

log = logging.getLogger(__name__)

LOG = "logs/capture_runner/runner.log"
POLL_S = 0.5
RERUN = "rerun the job once the cause is fixed: the shard's complete parts are kept, the rest is captured"
# What the runner's loaded model depends on; the other hidden-state settings (storage, thresholds) are
# each shard's own.
LOAD_KEYS = ("backend", "aux_layers", "final", "max_batch_tokens", *CAPTURE)


class CaptureFailed(RuntimeError):
    """The runner could not capture the shard; the message says why."""


def runner_service(settings: dict, threads: int, script: str | Path) -> Service:
    """The capture runner (`script`: scripts/capture_runner.py) for a hidden-state job's merged `settings`
    (model, hidden_states, tensor_parallel, handover)."""
    # The model's path is absolute: jobs of another workflow directory on the node do not share the runner.
    settings = {**settings, "model": {**settings["model"], "path": str(Path(settings["model"]["path"]).resolve())}}
    hidden = settings["hidden_states"]
    loads = {
        "model": settings["model"]["path"],
        "trust_remote_code": settings["model"]["trust_remote_code"],
        **{k: hidden[k] for k in LOAD_KEYS if k in hidden},
        "threads": threads,
    }
    args = [str(script), "--settings", json.dumps(settings, sort_keys=True), "--threads", str(threads)]
    capture = CAPTURE[hidden["backend"]]
    runner = hidden["runner"]
    python = runner.get("python")  # absent: this job's interpreter (torchrun's for a tensor-parallel backend)
    if capture.tensor_parallel:
        gpus = settings["tensor_parallel"]
        torchrun = [python, "-m", "torch.distributed.run"] if python else ["torchrun"]
        command = [*torchrun, "--standalone", "--nproc-per-node", str(gpus), *args]
        loads["tensor_parallel"] = gpus
    else:
        gpus = settings["tensor_parallel"] if capture.gpu(hidden[capture.name]) else 0
        command = [python or sys.executable, *args]
    return Service(
        name="capture runner",
        kind="capture_runner",
        model=settings["model"]["path"],
        key=json.dumps(loads, sort_keys=True),
        command=command,
        log=LOG,
        ready_timeout=runner["load_timeout"],
        idle_timeout=runner["idle_timeout"],
        gpus=gpus,
        handover=settings["handover"],
    )


def load_capture(settings: dict) -> CaptureBackend:
    """The configured backend's model, loaded for capture (under torchrun for `sglang`: this rank's slice)."""
    return CAPTURE[settings["hidden_states"]["backend"]].load(settings["hidden_states"], settings["model"])


# The runner's side


def serve(settings: dict) -> None:
    """Load the model, then capture the node's shard requests until the supervisor stops this process."""
    started = time.monotonic()
    capture = load_capture(settings)
    ranks = capture.ranks
    # the capture's processes on this node: one per GPU under torchrun, each busy with the forward passes
    processes = settings["tensor_parallel"] if CAPTURE[settings["hidden_states"]["backend"]].tensor_parallel else 1
    requests = Path(os.environ[SERVICE_DIR_ENV]) / "requests"
    if ranks.writer:
        requests.mkdir(exist_ok=True)
        log.info("capture runner loaded %s in %.1f s", settings["model"]["path"], time.monotonic() - started)
        mark_loaded()
    while True:
        request = ranks.agree(_next_request(requests) if ranks.writer else None)
        if request is None:
            time.sleep(POLL_S)
            continue
        _capture_request(request, capture, requests, processes)


def _next_request(requests: Path) -> dict | None:
    """The oldest request whose job is alive; requests of jobs that are gone are dropped."""
    for path in sorted(requests.glob("*.request.json")):
        with contextlib.suppress(OSError, ValueError):
            request = read_json(path)
            if pid_alive(request["pid"]):
                return request
        path.unlink(missing_ok=True)
    return None


def _capture_request(request: dict, capture: CaptureBackend, requests: Path, processes: int) -> None:
    # torch: the runner's side only
    from eagle3_datagen.formats.hidden_shard import layer_tap_path
    from eagle3_datagen.stages.hidden.layer_tap import record_layers
    from eagle3_datagen.stages.hidden.shard import ShardCancelled, capture_shard, writer_threads

    rid, writer = request["id"], capture.ranks.writer
    shard_log = logging.FileHandler(requests / f"{rid}.log") if writer else None
    if shard_log:
        shard_log.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        logging.getLogger().addHandler(shard_log)
    outcome = {"status": "failed"}
    try:
        log.info("capturing %s into %s for job %s", request["tokens"], request["out"], request["pid"])
        samples = read_jsonl(request["tokens"])
        job_gone = lambda: not pid_alive(request["pid"])  # noqa: E731
        settings = request["settings"]
        settings = {**settings, "writer_threads": writer_threads(settings["writer_threads"], processes)}
        with reporting_full_disk(request["out"]):
            index = capture_shard(samples, request["out"], capture, settings, cancelled=job_gone)
            if settings["layer_check_samples"]:  # the smoke run's layer check
                tap = layer_tap_path(request["out"])
                ids = record_layers(capture, capture.model, samples, settings["layer_check_samples"], tap)
                log.info("recorded every layer of %s into %s", ", ".join(ids), tap)
        outcome = {"status": "done", "samples": len(samples), "index": index is not None}
    except ShardCancelled as e:
        log.warning("%s", e)
        outcome = {"status": "cancelled"}
    except DiskFull as e:
        # The job's log says why and what to do; the traceback stays in the runner's log.
        outcome = {"status": "failed", "error": str(e)}
        raise
    except Exception:
        # The ranks may be out of step: this runner stops, the next job loads a fresh one.
        outcome = {"status": "failed", "error": traceback.format_exc()}
        raise
    finally:
        if writer:
            logging.getLogger().removeHandler(shard_log)
            shard_log.close()
            write_json(requests / f"{rid}.done.json", outcome)
            (requests / f"{rid}.request.json").unlink(missing_ok=True)


# The job's side


def capture_with_runner(
    tokens: str | Path, out_dir: str | Path, settings: dict, threads: int, script: str | Path
) -> None:
    """Capture one shard through the node's runner (`script`, started if none runs), copying its log to ours.

    A runner that exits before it takes the shard (one that failed on another shard and was going away
    as this job joined it) is replaced once."""
    request = {
        "pid": os.getpid(),
        "tokens": str(Path(tokens).resolve()),
        "out": str(Path(out_dir).resolve()),
        "settings": settings["hidden_states"],
    }
    for attempt in (1, 2):
        try:
            outcome = _request(runner_service(settings, threads, script), request)
            break
        except _RunnerGone as gone:
            if attempt == 2:
                raise ServerError(str(gone)) from None
            log.warning("the capture runner exited before it took this shard; starting a fresh one")
    if outcome["status"] != "done":
        error = str(outcome.get("error", outcome)).strip()
        # The cause first (a traceback's last line), since the console shows the first line.
        raise CaptureFailed(
            f"the capture runner failed on {tokens}: {error.splitlines()[-1]}\n{error}\n"
            f"It stopped (the next job starts a fresh one); {RERUN}"
        )


class _RunnerGone(Exception):
    """The runner exited before it took the request."""


def _request(service: Service, request: dict) -> dict:
    with using(service) as lease:
        requests = lease.directory / "requests"
        requests.mkdir(exist_ok=True)
        rid = f"{time.time_ns():020d}-{os.getpid()}"
        write_json(requests / f"{rid}.request.json", {"id": rid, **request})
        try:
            return _wait(lease, requests, rid)
        finally:
            for name in (f"{rid}.request.json", f"{rid}.done.json", f"{rid}.log"):
                (requests / name).unlink(missing_ok=True)


def _wait(lease: Lease, requests: Path, rid: str) -> dict:
    done, shard_log = requests / f"{rid}.done.json", requests / f"{rid}.log"
    copied = 0
    while True:
        finished = done.exists()  # before the last copy: every line is in the log by then
        with contextlib.suppress(OSError), open(shard_log, "rb") as f:
            f.seek(copied)
            chunk = f.read()
            copied += len(chunk)
            sys.stderr.buffer.write(chunk)
            sys.stderr.flush()
        if finished:
            return read_json(done)
        if not lease.running():
            message = f"the capture runner exited while capturing ({lease.log}):\n{lease.log_tail()}"
            if not shard_log.exists():  # the runner opens the shard's log when it takes the request
                raise _RunnerGone(message)
            raise ServerError(f"{message}\n{RERUN}")
        time.sleep(POLL_S)
