"""File I/O shared by every stage: atomic writes and line-numbered readers.

Every output is written under a temporary name in the destination directory and
renamed into place only when complete, so a killed job never leaves a file that
looks finished.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import orjson
import zstandard

ZSTD_LEVEL = 3


class InputError(ValueError):
    """Bad input, reported with the file, the line and how to fix it."""

    def __init__(self, path: str | os.PathLike, line: int | None, problem: str, fix: str):
        where = f"{path}:{line}" if line is not None else str(path)
        super().__init__(f"{where}: {problem}. Fix: {fix}")
        self.path = str(path)
        self.line = line


class DiskFull(OSError):
    """A write found its filesystem full (or the user's quota spent); the message names the path, the
    space left there and what to do."""


@contextlib.contextmanager
def reporting_full_disk(path: str | os.PathLike) -> Iterator[None]:
    """Raise a write's "No space left on device" (or "Disk quota exceeded") in the block as DiskFull,
    naming `path` (what was being written), its filesystem and the space left on it."""
    try:
        yield
    except DiskFull:
        raise
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        raise DiskFull(e.errno, full_disk_message(path, e)) from e


def full_disk_message(path: str | os.PathLike, error: OSError) -> str:
    existing = Path(path).resolve()
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    mount = existing
    while not os.path.ismount(mount):
        mount = mount.parent
    usage = shutil.disk_usage(existing)
    return (
        f"{os.strerror(error.errno)} writing {path}: {_size(usage.free)} free of {_size(usage.total)} on the "
        f"filesystem at {mount}. Free space there (or move the results to a larger disk) and rerun: what is "
        "complete is kept, and the rerun continues from it"
    )


def _size(n: int) -> str:
    for scale, unit in ((1 << 40, "TiB"), (1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside `path`; rename it to `path` on success."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        os.replace(tmp_path, path)
    finally:
        tmp_path.unlink(missing_ok=True)


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary directory beside `path`; rename it to `path` on success."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    try:
        yield tmp
        if path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def write_json(path: str | os.PathLike, obj: Any) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def read_json(path: str | os.PathLike) -> Any:
    return json.loads(Path(path).read_text())


def write_jsonl_zst(path: str | os.PathLike, rows: Iterable[dict]) -> int:
    """Write rows as zstd-compressed JSON lines, atomically. Returns the row count."""
    count = 0
    with (
        atomic_path(path) as tmp,
        open(tmp, "wb") as raw,
        zstandard.ZstdCompressor(level=ZSTD_LEVEL).stream_writer(raw) as out,
    ):
        for row in rows:
            out.write(orjson.dumps(row) + b"\n")
            count += 1
    return count


def _open_text_lines(path: Path) -> Iterator[bytes]:
    if path.name.endswith(".zst"):
        with open(path, "rb") as raw:
            reader = zstandard.ZstdDecompressor().stream_reader(raw)
            buffer = b""
            while chunk := reader.read(1 << 20):
                buffer += chunk
                *lines, buffer = buffer.split(b"\n")
                yield from lines
            if buffer:
                yield buffer
    else:
        with open(path, "rb") as f:
            for line in f:
                yield line.rstrip(b"\n")


def iter_jsonl(path: str | os.PathLike) -> Iterator[tuple[int, dict]]:
    """Yield (line number, object) from a .jsonl or .jsonl.zst file; blank lines are skipped."""
    path = Path(path)
    for line_no, line in enumerate(_open_text_lines(path), start=1):
        if not line.strip():
            continue
        try:
            obj = orjson.loads(line)
        except orjson.JSONDecodeError as exc:
            raise InputError(
                path, line_no, f"malformed JSON ({exc})", "make each line one complete JSON object"
            ) from None
        if not isinstance(obj, dict):
            raise InputError(
                path,
                line_no,
                f"expected a JSON object, got {type(obj).__name__}",
                "make each line one JSON object",
            )
        yield line_no, obj


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    return [obj for _, obj in iter_jsonl(path)]


def iter_records(path: str | os.PathLike) -> Iterator[tuple[int, dict]]:
    """Yield (record number, record) from .jsonl, .jsonl.zst, .json or .parquet sources.

    Record numbers are 1-based: the line for JSON lines, the array index + 1 for a JSON
    array, the row + 1 for parquet.
    """
    path = Path(path)
    name = path.name
    if not path.exists():
        raise InputError(path, None, "file not found", "check the partition's `source` path")
    if name.endswith((".jsonl", ".jsonl.zst")):
        yield from iter_jsonl(path)
    elif name.endswith(".json"):
        try:
            data = orjson.loads(path.read_bytes())
        except orjson.JSONDecodeError as exc:
            raise InputError(path, None, f"malformed JSON ({exc})", "the file must be one JSON array") from None
        if not isinstance(data, list):
            raise InputError(path, None, "expected a JSON array of records", "wrap the records in [...]")
        for index, obj in enumerate(data, start=1):
            if not isinstance(obj, dict):
                raise InputError(path, index, "expected a JSON object", "make every array item an object")
            yield index, obj
    elif name.endswith(".parquet"):
        import pyarrow.parquet as pq

        row = 0
        for batch in pq.ParquetFile(path).iter_batches(batch_size=4096):
            for obj in batch.to_pylist():
                row += 1
                yield row, obj
    else:
        raise InputError(
            path,
            None,
            "unknown file type",
            "use .jsonl, .jsonl.zst, .json or .parquet (or convert the file to one of them)",
        )
