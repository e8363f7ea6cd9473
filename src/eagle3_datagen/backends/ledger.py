"""The run-wide limits of one generation endpoint: one concurrency, one budget and one stop for every
shard job that uses it, on one machine or across SLURM jobs that share the working directory.

One ledger per endpoint (backend and model), `results/.ledger/<endpoint>/ledger.json`, which every
job reads and rewrites in place, whole, under an exclusive POSIX record lock (`fcntl.lockf`) a few
times a second. It holds:
- `jobs`: each live job's host (hostname and boot id), pid and the pid's start time, a heartbeat
  counter, the conversations it still wants to run, the concurrency it claims, and `reserved`: the worst
  case of its requests in flight (`reserve`, `settle`);
- `shards`: the spend (dollars, prompt + completion tokens) recorded in each shard's journal or output,
  failed rows' paid turns included;
- `stop`: set by a job whose answer says no request can succeed any more (a bad key, no credits, a
  refused parameter): every job stops starting requests, and later jobs start none.

Under a budget, a request is sent only once its worst case (`reserve`: its prompt and max tokens at the
price) fits beside the run's spend and every live job's reservations, checked and written under the
lock in one step; its answer (or failure) replaces the reservation by what it cost (`settle`), again in
one step. So the run's recorded spend plus what is in flight never passes the budget by more than the
reservations' error (an answer that costs more than its worst case). A killed job's reservations leave
with it, once it is found dead.

A job's claim only ever grows into what the live jobs' claims leave free, so the claims never add up
to more than the endpoint's concurrency, and a job never has more conversations in flight than it
claims. Each job aims at its fair share: the concurrency divided evenly among the live jobs (a job
that wants less, near its end, takes its want and leaves the rest to the others); above it, a job
starts nothing until its conversations in flight fall back. The jobs of one node's launched server
share it oldest first instead (`oldest_first`): the job that joined first takes what it wants, the
next what is left, so a shard runs at the server's full batch and the next one fills only what the
last one's long answers leave, and is under way when it ends. A job that ended normally removes
itself; one killed (kill -9, a lost node) is removed by the next job that looks: on its own host
when its pid is gone (or now belongs to another process), on another host when its heartbeat has
not moved for `STALE_S` seconds of the looker's own clock (no clocks are compared).

Why in place under a lock, not files renamed into place: fcntl locks are released by the kernel when
their process dies (kill -9 leaves no stale lock to break), and NFS's client flushes on unlock and
revalidates on lock, so a reader under the lock sees the last writer's bytes, which a rename seen
through another client's attribute cache does not promise. What it needs: POSIX locks that hold
across the nodes sharing the file (local disks; NFSv3 with lockd, NFSv4; Lustre mounted with
`flock`; GPFS; BeeGFS with global locks). A filesystem that refuses the lock stops the job saying
so. One that grants locks holding on one node only (NFS mounted `nolock` or `local_lock=all|posix`,
Lustre mounted `localflock`) says so only in its mount options: `node_local_locks` reads them from
/proc/self/mountinfo, and the preflight refuses a run whose API jobs span nodes there
(workflow/preflight.ledger_problems); `locks_exclude` checks that a lock taken by one process keeps
another out.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import logging
import os
import re
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import orjson

from eagle3_datagen.backends.service.record import pid_alive
from eagle3_datagen.formats.journal import journal_path, journal_spend
from eagle3_datagen.formats.spend import Spend

log = logging.getLogger(__name__)

FORMAT = "eagle3-datagen/ledger-v1"
# A job on another host is gone once its heartbeat has not moved for this long (it beats every tick).
STALE_S = 30.0


@dataclass(frozen=True)
class Synced:
    """What a job learns from one look at the ledger."""

    limit: int | None  # conversations it may have in flight (None: the ledger shares no concurrency)
    total: Spend  # the run's spend on the endpoint, this job's as it just wrote it included
    stop: str | None  # why the run was stopped, or None
    jobs: int  # live jobs on the endpoint, this one included
    reserved: Spend = Spend()  # the live jobs' reservations, this job's included
    own: Spend = Spend()  # this job's shard's spend as written (its first look: more than it said, see `sync`)


@dataclass(frozen=True)
class Reserved:
    """What `reserve` found: whether the request's worst case was reserved, the run's spend and the live
    jobs' reservations (this job's included, the new one not)."""

    held: bool
    total: Spend
    reserved: Spend


class LedgerError(RuntimeError):
    """The ledger cannot be used (its filesystem refuses locks): the message says what to do."""


def endpoint_key(backend: str, model: str) -> str:
    """The ledger's folder name: readable, and unique per (backend, model)."""
    digest = hashlib.sha256(f"{backend}\0{model}".encode()).hexdigest()[:12]
    return f"{backend}-{re.sub(r'[^A-Za-z0-9._-]+', '_', model)[:60]}-{digest}"


def _host() -> str:
    boot = ""
    with contextlib.suppress(OSError):
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()[:8]
    return f"{socket.gethostname()}/{boot}"


def _start_time(pid: int) -> str | None:
    """When `pid` started (clock ticks since boot, /proc), to tell it from a later process with its pid."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def oldest_first_shares(concurrency: int, wants: dict[str, int], joined: dict[str, int]) -> dict[str, int]:
    """`concurrency` given to the jobs in the order they `joined`, each its want while any is left."""
    shares, left = {}, concurrency
    for job in sorted(wants, key=lambda j: (joined[j], j)):
        shares[job] = min(wants[job], left)
        left -= shares[job]
    return shares


def fair_shares(concurrency: int, wants: dict[str, int]) -> dict[str, int]:
    """`concurrency` split among jobs by their wants: even shares, a job that wants less takes its want
    and the rest goes to the others; what does not divide goes to the first jobs by id."""
    shares = dict.fromkeys(wants, 0)
    left, open_jobs = concurrency, sorted(wants)
    while left > 0 and open_jobs:
        each, extra = divmod(left, len(open_jobs))
        satisfied = [j for j in open_jobs if wants[j] - shares[j] <= each]
        if satisfied:
            for job in satisfied:
                left -= wants[job] - shares[job]
                shares[job] = wants[job]
            open_jobs = [j for j in open_jobs if j not in satisfied]
            continue
        for i, job in enumerate(open_jobs):
            shares[job] += each + (i < extra)
        left = 0
    return shares


class Ledger:
    """One job's place in an endpoint's ledger. Every method takes the lock; calls from several threads
    of the job are serialized (POSIX locks belong to the process, so the process must not race itself)."""

    def __init__(
        self,
        directory: str | Path,
        backend: str,
        model: str,
        shard: str,
        concurrency: int | None,
        results: str | Path | None = None,
        oldest_first: bool = False,
    ):
        """`directory`: the run's ledgers (inference.ledger_dir); `shard`: this job's output path;
        `concurrency`: the endpoint's, shared among its jobs (None: only the budget and the stop are
        shared); `results`: the folder whose journals and stats a new ledger counts the spend of (None:
        the directory's parent, results/ for results/.ledger); `oldest_first`: the concurrency goes to the
        jobs in the order they joined, not in even shares."""
        self.root = Path(directory)
        self.results = Path(results) if results is not None else self.root.parent
        self.path = self.root / endpoint_key(backend, model) / "ledger.json"
        self.backend, self.model = backend, model
        self.shard = os.path.normpath(shard)
        self.concurrency = concurrency
        self.oldest_first = oldest_first
        self.host = _host()
        self.me = f"{self.host}:{os.getpid()}:{_start_time(os.getpid())}"
        self._seen: dict[str, tuple[int, float]] = {}  # other hosts' jobs: (heartbeat, when it last moved)
        self._beat = 0
        self._thread_lock = threading.Lock()
        self._fd: int | None = None

    # -- the locked file ---------------------------------------------------------------------------

    def _open(self) -> int:
        if self._fd is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
        return self._fd

    @contextlib.contextmanager
    def _locked(self):
        with self._thread_lock:
            fd = self._open()
            try:
                fcntl.lockf(fd, fcntl.LOCK_EX)
            except OSError as e:
                if e.errno in (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL):
                    raise LedgerError(
                        f"{self.path}: its filesystem refuses POSIX locks ({e.strerror}), which the run-wide "
                        "concurrency and budget need: put the working directory on a filesystem with locks that "
                        "hold across nodes (NFS with lockd or v4, Lustre mounted with flock, GPFS, a local disk)"
                    ) from None
                raise
            try:
                state = self._read(fd)
                yield state
                self._write(fd, state)
            finally:
                fcntl.lockf(fd, fcntl.LOCK_UN)

    def _read(self, fd: int) -> dict:
        size = os.fstat(fd).st_size
        data = os.pread(fd, size, 0) if size else b""
        try:
            state = orjson.loads(data) if data else None
        except orjson.JSONDecodeError:
            log.warning("%s: unreadable (a write cut short); counting the spend again", self.path)
            state = None
        if not isinstance(state, dict) or state.get("format") != FORMAT:
            state = {"format": FORMAT, "endpoint": {"backend": self.backend, "model": self.model}}
            state["shards"] = recorded_spend(self.results, self.backend, self.model)
            state["jobs"], state["stop"] = {}, None
        return state

    def _write(self, fd: int, state: dict) -> None:
        data = orjson.dumps(state)
        os.pwrite(fd, data, 0)
        os.ftruncate(fd, len(data))

    def close_file(self) -> None:
        with self._thread_lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None

    # -- what jobs do ------------------------------------------------------------------------------

    def _alive(self, job_id: str, job: dict, now: float) -> bool:
        if job["host"] == self.host:
            return pid_alive(job["pid"]) and _start_time(job["pid"]) == job["pid_start"]
        beat, since = self._seen.get(job_id, (None, now))
        if beat != job["beat"]:
            self._seen[job_id] = (job["beat"], now)
            return True
        return now - since < STALE_S

    def _drop_dead(self, jobs: dict, now: float) -> None:
        for job_id in [j for j in jobs if j != self.me]:
            if not self._alive(job_id, jobs[job_id], now):
                gone = jobs.pop(job_id)
                self._seen.pop(job_id, None)
                log.info(
                    "ledger: job %s (%s) is gone; its %s slots and its reservations (%s) return",
                    job_id,
                    gone["shard"],
                    gone["claim"],
                    gone.get("reserved") or Spend().as_dict(),
                )

    @staticmethod
    def _totals(state: dict) -> tuple[Spend, Spend]:
        """The run's recorded spend, and the live jobs' reservations."""
        total = sum((Spend.of(entry) for entry in state["shards"].values()), Spend())
        return total, sum((Spend.of(job.get("reserved") or {}) for job in state["jobs"].values()), Spend())

    def _mine(self, state: dict, reserved: Spend, spent: Spend) -> None:
        """Write this job's reservations and its shard's spend (its entry is written by `sync`, which every
        job does first; one another host took for dead, and dropped, is written again at the next sync)."""
        if self.me in state["jobs"]:
            state["jobs"][self.me]["reserved"] = reserved.as_dict()
        state["shards"][self.shard] = spent.as_dict()

    def reserve(self, worst: Spend, reserved: Spend, spent: Spend, fits, now: float) -> Reserved:
        """Reserve a request's `worst` case if the run's spend, the live jobs' reservations (this job's
        `reserved` before this one) and it together still `fits` (a test of a Spend: the budgets); with
        this job's shard's `spent`. Dead jobs are dropped first: their reservations return."""
        with self._locked() as state:
            self._drop_dead(state["jobs"], now)
            self._mine(state, reserved, spent)
            total, held = self._totals(state)
            if fits(total + held + worst):
                self._mine(state, reserved + worst, spent)
                return Reserved(True, total, held)
            return Reserved(False, total, held)

    def settle(self, reserved: Spend, spent: Spend) -> None:
        """A request came back: this job's reservations without it, and its shard's spend with what it cost."""
        with self._locked() as state:
            self._mine(state, reserved, spent)

    def sync(
        self, in_flight: int, wanted: int, spent: Spend, now: float, first: bool = False, reserved: Spend = Spend()
    ) -> Synced:
        """Write this job's heartbeat, want, spend and reservations; drop dead jobs; take this job's share of
        the concurrency (`in_flight`: its conversations in flight; `wanted`: those and the ones it has left;
        `spent`: its shard's whole spend, earlier runs' rows included). `first`: the job's first look,
        which also drops the spend of shards whose journal and output are both gone, and keeps what the
        ledger holds for this shard where it is more than `spent`: turns a killed job of the shard settled
        but never journaled (its conversations were cut), which were paid all the same."""
        with self._locked() as state:
            jobs, shards = state["jobs"], state["shards"]
            self._drop_dead(jobs, now)
            if first and self.shard in shards and _recorded(self.shard):
                before = Spend.of(shards[self.shard])
                if before.cost > spent.cost or before.tokens > spent.tokens:
                    log.info(
                        "ledger: %s paid for turns a killed job never journaled: %s kept", self.shard, before - spent
                    )
                    spent = Spend(max(before.cost, spent.cost), max(before.tokens, spent.tokens))
            if first:
                live_shards = {job["shard"] for job in jobs.values()} | {self.shard}
                for shard in [s for s in shards if s not in live_shards and not _recorded(s)]:
                    del shards[shard]
            self._beat += 1
            if self.me not in jobs:  # joins: the order `oldest_first` goes by
                state["joined"] = state.get("joined", 0) + 1
            mine = jobs.get(self.me) or {"claim": 0}
            joined_as = mine.get("joined", state.get("joined", 0))
            claim = limit = None
            if self.concurrency is not None:
                others = sum(job["claim"] for job_id, job in jobs.items() if job_id != self.me)
                wants = {job_id: job["want"] for job_id, job in jobs.items() if job_id != self.me}
                wants[self.me] = min(wanted, self.concurrency)
                if self.oldest_first:
                    joined = {job_id: job.get("joined", 0) for job_id, job in jobs.items()} | {self.me: joined_as}
                    fair = oldest_first_shares(self.concurrency, wants, joined)[self.me]
                else:
                    fair = fair_shares(self.concurrency, wants)[self.me]
                limit = max(0, min(fair, self.concurrency - others))
                claim = max(in_flight, limit)
            jobs[self.me] = {
                "host": self.host,
                "pid": os.getpid(),
                "pid_start": _start_time(os.getpid()),
                "shard": self.shard,
                "beat": self._beat,
                "want": min(wanted, self.concurrency or wanted),
                "claim": claim if claim is not None else mine["claim"],
                "joined": joined_as,
                "reserved": reserved.as_dict(),
            }
            shards[self.shard] = spent.as_dict()
            total, held = self._totals(state)
            return Synced(limit, total, (state.get("stop") or {}).get("reason"), len(jobs), held, spent)

    def stop_run(self, reason: str) -> None:
        """Stop every job of the endpoint: no request can succeed (the reason names the provider's answer)."""
        with self._locked() as state:
            if not state.get("stop"):
                state["stop"] = {"reason": reason, "shard": self.shard}

    def leave(self, spent: Spend) -> None:
        """This job ends: its claim returns, its shard's spend stays."""
        with contextlib.suppress(LedgerError), self._locked() as state:
            state["jobs"].pop(self.me, None)
            state["shards"][self.shard] = spent.as_dict()
        self.close_file()


def clear_stop(directory: str | Path, backend: str, model: str) -> bool:
    """Clear the endpoint's stop (its canary was just answered); whether there was one."""
    ledger = Ledger(directory, backend, model, "canary", None)
    if not ledger.path.exists():
        return False
    with ledger._locked() as state:
        had = bool(state.get("stop"))
        state["stop"] = None
    ledger.close_file()
    return had


def _recorded(shard: str) -> bool:
    """Whether a shard's spend is still recorded under results/: its journal or its output exists."""
    return journal_path(shard).exists() or Path(shard).exists()


def recorded_spend(results: Path, backend: str, model: str) -> dict[str, dict]:
    """The spend every shard of the endpoint has recorded under `results`: a finished shard's stats (its
    `spent`: every turn its journal paid for), an unfinished one's journal (every turn it records, failed
    rows' included). Read once, when the ledger is made."""
    spend: dict[str, dict] = {}
    for stats in sorted(results.glob("*/responses/*.stats.json")):
        with contextlib.suppress(OSError, ValueError):
            recorded = orjson.loads(stats.read_bytes())
            if (recorded.get("backend"), recorded.get("model")) == (backend, model):
                usage = recorded.get("usage") or {}
                tokens = int(usage.get("prompt_tokens", 0)) + int(usage.get("completion_tokens", 0))
                out = stats.with_name(stats.name.removesuffix(".stats.json") + ".jsonl.zst")
                # stats written before `spent` existed: the output's rows
                spent = recorded.get("spent") or {"cost": float(usage.get("cost", 0.0)), "tokens": tokens}
                spend[os.path.normpath(out)] = Spend.of(spent).as_dict()
    for journal in sorted(results.glob("*/responses/.*.journal.jsonl")):
        out = os.path.normpath(journal.with_name(journal.name.removeprefix(".").removesuffix(".journal.jsonl")))
        if out not in spend and not Path(out).exists():
            with contextlib.suppress(OSError, ValueError):
                found = journal_spend(journal, backend, model)
                if found is not None:
                    spend[out] = found
    return spend


@dataclass(frozen=True)
class Mount:
    """One line of /proc/self/mountinfo (proc(5)): where it is mounted, its type and source, and its
    per-mount and superblock options together."""

    point: str
    fstype: str
    source: str
    options: frozenset[str]


def parse_mountinfo(text: str) -> list[Mount]:
    """Each line: ID, parent ID, major:minor, root, mount point, mount options, optional fields, "-",
    filesystem type, source, superblock options; a space in a path is written \\040 (octal)."""
    mounts = []
    for line in text.splitlines():
        before, sep, after = line.partition(" - ")
        fields, rest = before.split(), after.split()
        if not sep or len(fields) < 6 or len(rest) < 2:
            continue
        options = fields[5].split(",") + (rest[2].split(",") if len(rest) > 2 else [])
        mounts.append(Mount(_unescape(fields[4]), rest[0], _unescape(rest[1]), frozenset(options)))
    return mounts


def _unescape(field: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), field)


def mount_of(path: str | Path, mounts: list[Mount]) -> Mount | None:
    """The mount `path` is on: the last mounted of those with the longest mount point above it."""
    resolved = os.path.realpath(path)
    found = None
    for mount in mounts:
        inside = resolved == mount.point or resolved.startswith(mount.point.rstrip("/") + "/")
        if inside and (found is None or len(mount.point) >= len(found.point)):
            found = mount
    return found


def node_local_locks(mount: Mount) -> str | None:
    """The mount option under which the mount's POSIX locks hold on this node only, or None. NFS: `nolock`
    (no lockd: locks are the client's own; nfs(5): it overrides local_lock) or `local_lock=all|posix`;
    Lustre: `localflock` (mount.lustre(8): client-local locks)."""
    if mount.fstype in ("nfs", "nfs4"):
        return next((o for o in ("nolock", "local_lock=all", "local_lock=posix") if o in mount.options), None)
    if mount.fstype == "lustre" and "localflock" in mount.options:
        return "localflock"
    return None


# A child process takes the lock, says so, and holds it until its stdin closes.
_HOLD = (
    "import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o666); "
    "fcntl.lockf(fd, fcntl.LOCK_EX); print('held', flush=True); sys.stdin.read()"
)


def locks_exclude(directory: str | Path) -> bool:
    """Whether a POSIX lock one process holds on a file in `directory` keeps another process out (a
    filesystem whose locks do nothing grants both)."""
    probe = Path(directory) / f".lock-check-{os.getpid()}"
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLD, str(probe)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        if holder.stdout.readline().strip() != "held":
            return False
        fd = os.open(probe, os.O_RDWR)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            return e.errno in (errno.EACCES, errno.EAGAIN)
        finally:
            os.close(fd)
        return False
    finally:
        holder.stdin.close()
        holder.wait()
        probe.unlink(missing_ok=True)
