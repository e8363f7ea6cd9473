"""An append-only journal of finished response rows: a killed job loses nothing, and a shard's answers
outlive its output.

Each finished prompt (a success or a failure with its reason) is appended as one JSON line and flushed
as soon as it completes. A rerun reads the journal, keeps every answered id and appends the rest; a
failed row is not kept, so the rerun asks for it again (a later line for an id replaces an earlier
one), unless the provider refused the prompt itself `ASKS_PER_REFUSAL` times (`asked`: how many runs
it did): that row is kept, failed.
The first line fingerprints the settings that shape a response. A journal written under other
settings is moved aside, never mixed in, unless the caller says which of its rows the new settings
would still produce (a raised token limit keeps the answers that ended within the old one): those are
kept, the journal rewritten with them under the new fingerprint. The journal stays beside the output
when the shard is done (Snakemake deletes a job's outputs before it runs it again; the journal is no
output). The header says when the journal was begun (`started`). A line torn by `kill -9` is cut off when the
journal is reopened. `read_journal` reads one while its job appends (the live status).

What the shard paid (`Journal.spent`, `journal_spend`) is every line's turns, a failed row's and one a
later line replaced included (each was paid for), plus the header's `carried`: the spend of the rows a
rewrite under raised length limits left out. A journal moved aside (other settings) takes its spend along.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import orjson

from eagle3_datagen.formats.spend import Spend

log = logging.getLogger(__name__)

FORMAT = "eagle3-datagen/responses-journal-v1"
# How many runs ask a prompt the provider refused (too long, flagged): a refusal is of the prompt, and each
# ask is billed where the provider read the prompt; the second covers a refusal that was the provider's
# (a route since changed).
ASKS_PER_REFUSAL = 2


def journal_path(out_path: str | Path) -> Path:
    out_path = Path(out_path)
    return out_path.with_name(f".{out_path.name}.journal.jsonl")


def row_spend(row: dict) -> Spend:
    """What a row's regenerated turns cost, with what its failed requests were billed (a turn's `lost_*`, a
    failed row's `lost`)."""
    spend = Spend.of(row.get("lost") or {})
    for message in row["messages"]:
        if message["role"] == "assistant":
            spend += Spend.of_usage(message.get("usage"))
    return spend


def _parse(path: str | Path) -> tuple[dict, dict[str, dict], int, Spend]:
    """(header, every row by id (a later line for an id replaces an earlier one), bytes of complete lines,
    the spend of every line and the header's `carried`): a torn or half-written last line left out.

    Every line was paid for, a failed row or one a later line replaced too: the spend counts them all."""
    data = Path(path).read_bytes()
    complete = data[: data.rfind(b"\n") + 1]
    lines = complete.splitlines()
    header = orjson.loads(lines[0]) if lines else {}
    spent = Spend.of(header.get("carried") or {})
    rows = {}
    for line in lines[1:]:
        row = orjson.loads(line)
        rows[row["id"]] = row
        spent += row_spend(row)
    return header, rows, len(complete), spent


def kept(row: dict) -> bool:
    """Whether a rerun keeps `row`: an answer, or a prompt refused `ASKS_PER_REFUSAL` times."""
    return row["status"] != "failed" or row.get("asked", 0) >= ASKS_PER_REFUSAL


def _read(path: Path) -> tuple[dict, dict[str, dict], dict[str, int], int, Spend]:
    """`_parse` split into the rows a rerun keeps and, for the refused prompts it asks again, how many runs
    asked each."""
    header, rows, complete, spent = _parse(path)
    refused = {k: r["asked"] for k, r in rows.items() if not kept(r) and r.get("asked")}
    return header, {k: r for k, r in rows.items() if kept(r)}, refused, complete, spent


def journal_spend(path: Path, backend: str, model: str) -> dict | None:
    """The spend of every turn a journal records (failed rows' paid turns included), if it exists and was
    written by `backend` for `model`."""
    if not path.exists():
        return None
    header, _, _, spent = _parse(path)
    fingerprint = orjson.loads(header.get("fingerprint") or "{}")
    if (fingerprint.get("backend"), fingerprint.get("model")) != (backend, model):
        return None
    return spent.as_dict()


class Journal:
    def __init__(
        self,
        path: str | Path,
        fingerprint: str,
        still_valid: Callable[[str], Callable[[dict], bool] | None] = lambda _old: None,
    ):
        """`still_valid(old_fingerprint)`: for a journal written under other settings, which of its rows
        the current ones would still produce (a test of a row), or None: none of them."""
        self.path = Path(path)
        self.fingerprint = fingerprint
        self.rows: dict[str, dict] = {}
        self.refused_asks: dict[str, int] = {}  # a refused prompt asked again: how many runs asked it before
        # What every turn the journal records cost (failed rows', and those a rewrite left out, included).
        self.spent = Spend()
        self._load(still_valid)
        self._file = self.path.open("ab")

    def _load(self, still_valid) -> None:
        if not self.path.exists():
            self._start([])
            return
        header, rows, refused, complete, spent = _read(self.path)
        if header.get("format") == FORMAT and header.get("fingerprint") != self.fingerprint:
            valid = still_valid(header.get("fingerprint") or "{}")
            if valid is not None:
                kept = [row for row in rows.values() if valid(row)]
                log.info(
                    "%s: written under other length limits; kept the %d of %d answers that ended within them, "
                    "asking again for the rest",
                    self.path,
                    len(kept),
                    len(rows),
                )
                self._start(kept, carried=spent)  # the same endpoint paid for the rows left out
                return
        if header.get("format") != FORMAT or header.get("fingerprint") != self.fingerprint:
            stale = self.path.with_name(self.path.name + ".stale")
            os.replace(self.path, stale)
            log.warning("%s was written under other settings; moved to %s, starting afresh", self.path, stale)
            self._start([])
            return
        size = self.path.stat().st_size
        if complete < size:
            log.warning("%s: cut a torn last line (%d bytes) left by a killed run", self.path, size - complete)
            with self.path.open("r+b") as f:
                f.truncate(complete)
        self.rows, self.refused_asks, self.spent = rows, refused, spent
        log.info("%s: %d answered rows from earlier runs", self.path, len(self.rows))

    def _start(self, rows: list[dict], carried: Spend = Spend()) -> None:
        """A fresh journal holding `rows` (some of the journal it replaces, whose spend was `carried`: the
        rows left out stay counted in the header), written whole under a temporary name and renamed."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        left_out = carried - sum((row_spend(row) for row in rows), Spend())
        header = {"format": FORMAT, "fingerprint": self.fingerprint, "started": time.time()}
        if left_out.cost > 0 or left_out.tokens > 0:
            header["carried"] = left_out.as_dict()
        lines = [orjson.dumps(header), *(orjson.dumps(row) for row in rows)]
        partial = self.path.with_name(self.path.name + ".partial")
        partial.write_bytes(b"\n".join(lines) + b"\n")
        os.replace(partial, self.path)
        self.rows = {row["id"]: row for row in rows}
        self.spent = carried

    def append(self, row: dict) -> None:
        self._file.write(orjson.dumps(row) + b"\n")
        self._file.flush()
        self.rows[row["id"]] = row
        self.spent += row_spend(row)

    def close(self) -> None:
        self._file.close()


def read_journal(path: str | Path) -> tuple[dict, dict[str, dict]]:
    """A journal as another process reads it while its job appends: its header (`started`: when the
    journal was begun, seconds since the epoch) and its finished rows by id (a later line for an id
    replaces an earlier one), the line being written left out. Nothing is changed."""
    header, rows, _, _ = _parse(path)
    return header, rows
