"""The handover of the node's GPUs between its services: a service starts only once the GPUs it will use
have their memory back.

Killing a service's process group does not give its GPU memory back at once: the driver frees a
process's memory when the process is gone, which for SGLang's tensor-parallel workers (or a capture
runner's ranks) can take seconds to minutes after the group was signalled; and SGLang sizes its KV
cache from the free memory it sees when it starts (`mem_fraction_static`), so a server that starts
early either fails or runs with a smaller cache for the rest of the week. The supervisor therefore
waits, up to `resources.handover.timeout` seconds, until every GPU the service will use reports at
most `resources.handover.max_used_mib` in use, and otherwise fails naming the processes that still
hold memory (pid, name, MiB).

The numbers come from `nvidia-smi` (`--query-gpu`, `--query-compute-apps`), which every NVIDIA driver
installs beside NVML: no library to pin, and the same figures NVML gives. The GPUs checked are those
`CUDA_VISIBLE_DEVICES` names (indices or UUIDs; under SLURM the allocation's), else every GPU
nvidia-smi lists (with SLURM's ConstrainDevices, the allocation's only).
"""

from __future__ import annotations

import csv
import logging
import os
import shutil
import subprocess
import time
from dataclasses import dataclass

from eagle3_datagen.backends.service import ServiceError

log = logging.getLogger(__name__)

NVIDIA_SMI = "nvidia-smi"
POLL_S = 2.0
# How often the wait says who still holds memory.
REPORT_EVERY_S = 30.0


@dataclass(frozen=True)
class Gpu:
    index: int
    uuid: str
    used_mib: int
    total_mib: int


@dataclass(frozen=True)
class Holder:
    """A process that holds memory on a GPU."""

    pid: int
    name: str
    used_mib: int
    gpu_uuid: str

    def describe(self, gpus: list[Gpu]) -> str:
        index = next((g.index for g in gpus if g.uuid == self.gpu_uuid), self.gpu_uuid)
        return f"pid {self.pid} ({self.name}, {self.used_mib} MiB on GPU {index})"


def _query(*args: str) -> list[list[str]]:
    """Rows of an `nvidia-smi --query-...` in CSV, without header or units."""
    try:
        out = subprocess.run(
            [NVIDIA_SMI, *args, "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=60
        )
    except subprocess.TimeoutExpired:
        stuck = f"{NVIDIA_SMI} {' '.join(args)} did not answer within 60 s: the GPU driver is stuck"
        raise ServiceError(stuck) from None
    if out.returncode != 0:
        raise ServiceError(f"{NVIDIA_SMI} {' '.join(args)} failed ({out.returncode}): {out.stderr.strip()}")
    return [[field.strip() for field in row] for row in csv.reader(out.stdout.splitlines()) if row]


def _mib(field: str) -> int:
    """A memory figure; nvidia-smi says `[N/A]` (MIG, some drivers) where it has none."""
    return int(field) if field.isdigit() else 0


def query_gpus() -> list[Gpu]:
    rows = _query("--query-gpu=index,uuid,memory.used,memory.total")
    return [Gpu(int(i), uuid, _mib(used), _mib(total)) for i, uuid, used, total in rows]


def query_holders() -> list[Holder]:
    rows = _query("--query-compute-apps=pid,process_name,used_memory,gpu_uuid")
    return [Holder(int(pid), name, _mib(used), uuid) for pid, name, used, uuid in rows]


def visible(gpus: list[Gpu], cuda_visible_devices: str | None) -> list[Gpu]:
    """The GPUs `CUDA_VISIBLE_DEVICES` names (by index or UUID), all of them where it is not set."""
    if cuda_visible_devices is None:
        return gpus
    named = [d.strip() for d in cuda_visible_devices.split(",") if d.strip()]
    return [g for g in gpus if str(g.index) in named or any(g.uuid.startswith(d) for d in named if not d.isdigit())]


def busy(gpus: list[Gpu], max_used_mib: int) -> list[Gpu]:
    return [g for g in gpus if g.used_mib > max_used_mib]


def describe_busy(busy_gpus: list[Gpu], holders: list[Holder], all_gpus: list[Gpu]) -> str:
    """The GPUs still in use and the processes holding their memory."""
    on = {g.uuid for g in busy_gpus}
    held = [h for h in holders if h.gpu_uuid in on]
    gpus = ", ".join(f"GPU {g.index} {g.used_mib} of {g.total_mib} MiB" for g in busy_gpus)
    if not held:
        return f"{gpus} in use; nvidia-smi names no process (one of another container or user, or a driver leak)"
    return f"{gpus} in use, held by " + "; ".join(h.describe(all_gpus) for h in held)


def wait_for_free_memory(timeout: float, max_used_mib: int, what: str) -> float:
    """Wait until the GPUs this process will use report at most `max_used_mib` MiB in use each; raise
    ServiceError naming the holders after `timeout` s. Returns the seconds waited. Without nvidia-smi
    (no NVIDIA driver: a CPU run, the SLURM test cluster's stand-in GPUs) nothing is checked, and the
    log says so."""
    if shutil.which(NVIDIA_SMI) is None:
        log.warning("no %s on PATH: not checking that the GPUs' memory is free before the %s starts", NVIDIA_SMI, what)
        return 0.0
    started = time.monotonic()
    reported = None
    while True:
        gpus = visible(query_gpus(), os.environ.get("CUDA_VISIBLE_DEVICES"))
        still = busy(gpus, max_used_mib)
        waited = time.monotonic() - started
        if not still:
            if reported is not None:
                log.info("the GPUs' memory is free after %.1f s; starting the %s", waited, what)
            return waited
        if waited > timeout:
            raise ServiceError(
                f"the GPUs' memory was not free after {timeout:g} s, so the {what} did not start: "
                f"{describe_busy(still, query_holders(), gpus)}. Stop those processes (or wait for them to exit) "
                "and rerun; resources.handover sets the wait and the MiB a GPU may still use"
            )
        if reported is None or time.monotonic() - reported > REPORT_EVERY_S:
            held = describe_busy(still, query_holders(), gpus)
            log.info("waiting for the GPUs' memory before the %s starts: %s", what, held)
            reported = time.monotonic()
        time.sleep(POLL_S)
