"""The space a quota leaves on a filesystem, read where the filesystem tells it.

Clusters hand out quotas per user, group or project on Lustre, GPFS and NFS: `statvfs` then reports the
filesystem's free space (petabytes), and a write fails with EDQUOT once the quota is spent. Lustre
reports its quotas with `lfs quota` (lfs.c's `print_quota`), GPFS (IBM Storage Scale) with `mmlsquota
-Y` (colon-separated records under a HEADER record that names the fields), the others, NFS (through
rpc.rquotad) included, with the Linux quota tools' `quota` (quota-tools 4.x, quota.c's `showquotas`).
`lfs quota` and `quota` print one row per filesystem and quota type: the filesystem (on a line of its
own where it is long), then space used, soft and hard limit in KiB and its grace, then the same for files:

    Disk quotas for user alice (uid 1000):
         Filesystem  blocks   quota   limit   grace   files   quota   limit   grace
          /dev/sdb1  104857*  102400  204800 1733452800    12       0       0       0

A used value over a limit carries `*`; Lustre puts `[...]` around values it could not read from every
target, and a title alone ("...: none") where nothing is limited. A quota tool that is missing, fails,
or reports no limit leaves the filesystem's free space as the only bound.
"""

from __future__ import annotations

import getpass
import grp
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

KIB = 1024
TOOL_TIMEOUT_S = 30
GPFS_BIN = "/usr/lpp/mmfs/bin"  # where IBM Storage Scale installs its commands, often not on PATH
NUMBER = re.compile(r"^\[?(\d+)\*?\]?\*?$")


@dataclass(frozen=True)
class QuotaRow:
    """One quota of a report: its title (whose quota), the space used and the limits, in bytes (0: none)."""

    title: str
    used: int
    soft: int
    hard: int

    @property
    def left(self) -> int | None:
        """What the tighter limit leaves (a soft limit is enforced once its grace runs out), None without one."""
        limits = [limit for limit in (self.soft, self.hard) if limit]
        return max(0, min(limits) - self.used) if limits else None


def parse_report(text: str) -> list[QuotaRow]:
    """The rows of a `quota -w -p` or `lfs quota` report (the layout in this module's docstring)."""
    rows, title = [], ""
    for line in text.splitlines():
        if line.startswith("Disk quotas for "):
            title = line.removeprefix("Disk quotas for ").rsplit(" (", 1)[0]  # "user alice (uid 1000): ..."
            continue
        fields = line.split()
        # space used, soft, hard, grace, files, soft, hard, grace: the last eight fields of a row
        if len(fields) < 8 or fields[0] == "Filesystem":
            continue
        space = [NUMBER.match(field) for field in fields[-8:-5]]
        if all(space):
            used, soft, hard = (int(m.group(1)) * KIB for m in space)
            rows.append(QuotaRow(title, used, soft, hard))
    return rows


def parse_mmlsquota(text: str, device: str) -> list[QuotaRow]:
    """The rows of `mmlsquota -Y` for the file system `device` (its name, or /dev/ and its name): usage,
    soft and hard limit in KiB, and the usage in doubt, which counts as used (the in-doubt value and the
    usage together may not exceed the hard limit)."""
    fields, rows = None, []
    for line in text.splitlines():
        record = line.split(":")
        if len(record) < 3 or record[0] != "mmlsquota":
            continue
        if record[2] == "HEADER":
            fields = record
            continue
        if fields is None or len(record) < len(fields):
            continue
        row = dict(zip(fields, record, strict=False))
        if row.get("filesystemName") != device.removeprefix("/dev/"):
            continue
        try:
            used = int(row["blockUsage"]) + int(row.get("blockInDoubt") or 0)
            soft, hard = int(row["blockQuota"]), int(row["blockLimit"])
        except (KeyError, ValueError):
            continue
        title = f"{row.get('quotaType', '').lower()} {row.get('name') or row.get('filesetname') or ''}".strip()
        rows.append(QuotaRow(title, used * KIB, soft * KIB, hard * KIB))
    return rows


@dataclass(frozen=True)
class QuotaLeft:
    """What the tightest quota on a filesystem leaves, and which report said so."""

    left: int
    said: str  # e.g. "user alice's quota (quota -u -g -w -p -f /home)"


def mounted(mount: Path) -> tuple[str, str] | None:
    """(device, type) /proc/mounts gives the filesystem mounted at `mount` (the last mount there wins)."""
    found = None
    try:
        with open("/proc/mounts") as f:
            for line in f:
                fields = line.split()
                if len(fields) > 2 and fields[1].replace("\\040", " ") == str(mount):
                    found = fields[0], fields[2]
    except OSError:
        return None
    return found


def quota_commands(mount: Path, device: str, fs_type: str | None) -> list[list[str]]:
    """The reports that tell the quotas of the user and their group on the filesystem at `mount`."""
    user, group = getpass.getuser(), grp.getgrgid(os.getgid()).gr_name
    if fs_type == "lustre":
        return [["lfs", "quota", "-u", user, str(mount)], ["lfs", "quota", "-g", group, str(mount)]]
    if fs_type == "gpfs":
        return [["mmlsquota", "-u", user, "-Y", device], ["mmlsquota", "-g", group, "-Y", device]]
    # -w: no wrapped rows; -p: grace as a number (always a field); -f: this filesystem only
    return [["quota", "-u", "-g", "-w", "-p", "-f", str(mount)]]


def quota_left(mount: Path, environ: dict[str, str] | None = None) -> QuotaLeft | None:
    """What the tightest quota of the user or their groups leaves on the filesystem at `mount`; None where
    no quota tool is installed or none reports a limit there."""
    environ = dict(os.environ if environ is None else environ)
    device, fs_type = mounted(mount) or ("", None)
    tightest = None
    for command in quota_commands(mount, device, fs_type):
        tool = shutil.which(command[0], path=environ.get("PATH")) or shutil.which(command[0], path=GPFS_BIN)
        if tool is None:
            continue
        try:  # `quota` exits 1 when a quota is exceeded: its report is what counts
            report = subprocess.run(
                [tool, *command[1:]], capture_output=True, text=True, env=environ, timeout=TOOL_TIMEOUT_S
            )
        except (OSError, subprocess.TimeoutExpired):
            continue
        rows = parse_mmlsquota(report.stdout, device) if fs_type == "gpfs" else parse_report(report.stdout)
        for row in rows:
            if row.left is not None and (tightest is None or row.left < tightest.left):
                tightest = QuotaLeft(row.left, f"{row.title}'s quota ({' '.join(command)})")
    return tightest
