"""An append-only journal of finished response rows, so that a killed job loses nothing.

Each finished prompt (a success or a failure with its reason) is appended as one JSON line
and flushed as soon as it completes. A rerun reads the journal, skips every id in it and
appends the rest. The first line fingerprints the settings that shape a response: a journal
written under other settings is moved aside, never mixed in, and says when the journal was begun. A
line torn by `kill -9` is cut off when the journal is reopened. `read_journal` reads one while its job
appends (the live status).
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import orjson

log = logging.getLogger(__name__)

FORMAT = "eagle3-datagen/responses-journal-v1"


def journal_path(out_path: str | Path) -> Path:
    out_path = Path(out_path)
    return out_path.with_name(f".{out_path.name}.journal.jsonl")


class Journal:
    def __init__(self, path: str | Path, fingerprint: str):
        self.path = Path(path)
        self.fingerprint = fingerprint
        self.rows: dict[str, dict] = {}
        self._load()
        self._file = self.path.open("ab")

    def _load(self) -> None:
        if not self.path.exists():
            self._start()
            return
        data = self.path.read_bytes()
        complete = data[: data.rfind(b"\n") + 1]
        lines = complete.splitlines()
        header = orjson.loads(lines[0]) if lines else {}
        if header.get("format") != FORMAT or header.get("fingerprint") != self.fingerprint:
            stale = self.path.with_name(self.path.name + ".stale")
            os.replace(self.path, stale)
            log.warning("%s was written under other settings; moved to %s, starting afresh", self.path, stale)
            self._start()
            return
        if len(complete) < len(data):
            log.warning(
                "%s: cut a torn last line (%d bytes) left by a killed run", self.path, len(data) - len(complete)
            )
            with self.path.open("r+b") as f:
                f.truncate(len(complete))
        for line in lines[1:]:
            row = orjson.loads(line)
            self.rows[row["id"]] = row
        log.info("%s: %d finished rows from earlier runs", self.path, len(self.rows))

    def _start(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        header = {"format": FORMAT, "fingerprint": self.fingerprint, "started": time.time()}
        self.path.write_bytes(orjson.dumps(header) + b"\n")

    def append(self, row: dict) -> None:
        self._file.write(orjson.dumps(row) + b"\n")
        self._file.flush()
        self.rows[row["id"]] = row

    def close(self) -> None:
        self._file.close()

    def remove(self) -> None:
        self.close()
        self.path.unlink(missing_ok=True)


def read_journal(path: str | Path) -> tuple[dict, dict[str, dict]]:
    """A journal as another process reads it while its job appends: its header (`started`: when the
    journal was begun, seconds since the epoch) and its finished rows by id (a later line for an id
    replaces an earlier one), the line being written left out. Nothing is changed."""
    data = Path(path).read_bytes()
    lines = data[: data.rfind(b"\n") + 1].splitlines()
    if not lines:
        return {}, {}
    rows = {}
    for line in lines[1:]:
        row = orjson.loads(line)
        rows[row["id"]] = row
    return orjson.loads(lines[0]), rows
