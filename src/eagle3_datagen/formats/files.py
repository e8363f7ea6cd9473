"""File I/O shared by every stage: atomic writes and line-numbered readers.

Every output is written under a temporary name in the destination directory and
renamed into place only when complete, so a killed job never leaves a file that
looks finished.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
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


def _create_beside(path: Path, make) -> Path:
    """A new hidden name beside `path`, made with `make(name)`. Unlike tempfile's mkstemp (0600) and
    mkdtemp (0700), the caller's modes (0666 for files, 0777 for directories) apply, less the umask:
    outputs are as readable as any other file the user makes, e.g. by the group on a shared cluster."""
    path.parent.mkdir(parents=True, exist_ok=True)
    while True:
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
        try:
            make(tmp)
            return tmp
        except FileExistsError:
            continue


def _create_file(path: Path) -> None:
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside `path`; rename it to `path` on success."""
    path = Path(path)
    tmp_path = _create_beside(path, _create_file)
    try:
        yield tmp_path
        os.replace(tmp_path, path)
    finally:
        tmp_path.unlink(missing_ok=True)


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary directory beside `path`; rename it to `path` on success."""
    path = Path(path)
    tmp = _create_beside(path, os.mkdir)
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
