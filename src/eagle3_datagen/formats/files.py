"""File I/O shared by every stage: atomic writes and line-numbered readers.

Every output is written under a temporary name in the destination directory and
renamed into place only when complete, so a killed job never leaves a file that
looks finished.
"""

from __future__ import annotations

import contextlib
import errno
import importlib
import io
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
    with atomic_path(path) as tmp, zstandard.open(tmp, "wb", cctx=zstandard.ZstdCompressor(level=ZSTD_LEVEL)) as out:
        for row in rows:
            out.write(orjson.dumps(row) + b"\n")
            count += 1
    return count


# Compressed JSON lines, each opened by its own library's `open` as a stream: nothing is decompressed whole.
# zstandard's reads every frame of a file of several (`cat a.zst b.zst`, pzstd's output).
COMPRESSED = {".gz": "gzip", ".bz2": "bz2", ".xz": "lzma", ".zst": "zstandard"}
JSON_SUFFIXES = tuple(f"{kind}{zip_}" for kind in (".jsonl", ".json") for zip_ in ("", *COMPRESSED))
SOURCE_SUFFIXES = (*JSON_SUFFIXES, ".parquet", ".arrow")


def _open_binary(path: Path):
    """The file's decompressed bytes as a stream, by its compression suffix."""
    suffix = path.suffix
    if suffix in COMPRESSED:
        return importlib.import_module(COMPRESSED[suffix]).open(path, "rb")
    return open(path, "rb")  # noqa: SIM115 - closed by the caller's `with`


def _open_text_lines(path: Path) -> Iterator[bytes]:
    with _open_binary(path) as raw, io.BufferedReader(raw, 1 << 20) as lines:
        for line in lines:
            yield line.rstrip(b"\n")


def _not_utf8(path: Path, line_no: int, line: bytes, exc: UnicodeDecodeError) -> InputError:
    """An encoding error names what the bytes look like and the conversion that fixes the file."""
    if line_no == 1 and line.startswith((b"\xff\xfe", b"\xfe\xff")):
        found = "UTF-16 (it starts with a UTF-16 byte-order mark)"
        source = "utf-16"
    else:
        byte = f"byte 0x{line[exc.start]:02x} at position {exc.start + 1} of the line"
        found = f"not UTF-8 ({byte}); Latin-1 or Windows-1252 likely"
        source = "latin1"
    name = path.name
    return InputError(
        path,
        line_no,
        f"the file's encoding is {found}; JSON sources must be UTF-8",
        f"convert it, e.g. `iconv -f {source} -t utf-8 {name} > {name}.utf8` (if the text is not {source}, "
        "name its encoding instead), and point `source` at the converted file",
    )


def iter_jsonl(path: str | os.PathLike, bad=None) -> Iterator[tuple[int, dict]]:
    """Yield (line number, object) from JSON lines, plain or compressed (.gz, .bz2, .xz, .zst); blank
    lines are skipped.

    A line that is not one JSON object raises InputError, or, given `bad`, is passed to
    `bad(line, reason)` and skipped. A file that is not UTF-8 always raises: every line would be bad.
    """
    path = Path(path)
    for line_no, line in enumerate(_open_text_lines(path), start=1):
        if line_no == 1 and line.startswith(b"\xef\xbb\xbf"):  # a UTF-8 byte-order mark
            line = line[3:]
        if not line.strip():
            continue
        try:
            obj = orjson.loads(line)
        except orjson.JSONDecodeError as exc:
            try:  # orjson also refuses bytes that are not UTF-8: say so, as no line of the file would read
                line.decode("utf-8")
            except UnicodeDecodeError as encoding:
                raise _not_utf8(path, line_no, line, encoding) from None
            problem = f"malformed JSON ({exc})"
            if bad is None:
                raise InputError(path, line_no, problem, "make each line one complete JSON object") from None
            bad(line_no, problem)
            continue
        if not isinstance(obj, dict):
            problem = f"expected a JSON object, got {type(obj).__name__}"
            if bad is None:
                raise InputError(path, line_no, problem, "make each line one JSON object")
            bad(line_no, problem)
            continue
        yield line_no, obj


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    return [obj for _, obj in iter_jsonl(path)]


def iter_records(path: str | os.PathLike, bad=None) -> Iterator[tuple[int, dict]]:
    """Yield (record number, record) from one source file: JSON lines or a JSON array (.jsonl, .json,
    plain or .gz, .bz2, .xz, .zst), Parquet, or Arrow (the IPC stream `datasets` writes, or the IPC file).

    Record numbers are 1-based: the line for JSON lines, the array index + 1 for a JSON array, the
    row + 1 for Parquet and Arrow. Given `bad`, a record that is not a JSON object is passed to
    `bad(number, reason)` and skipped instead of raising. A null column value of a Parquet or Arrow
    row is left out, as the key it stands for is missing from the JSON record it was written from.
    """
    path = Path(path)
    name = path.name
    if not path.exists():
        raise InputError(path, None, "file not found", "check the partition's `source` path")
    if name.endswith(JSON_SUFFIXES):
        if _is_json_array(path):
            yield from _iter_json_array(path, bad)
        else:
            yield from iter_jsonl(path, bad)
    elif name.endswith(".parquet"):
        import pyarrow.parquet as pq

        yield from _iter_rows(pq.ParquetFile(path).iter_batches(batch_size=4096))
    elif name.endswith(".arrow"):
        yield from _iter_rows(_arrow_batches(path))
    else:
        raise InputError(
            path,
            None,
            "unknown file type",
            f"use one of {', '.join(SOURCE_SUFFIXES)} (or convert the file to one of them)",
        )


def _is_json_array(path: Path) -> bool:
    """A .json file may hold one array of records or JSON lines (as many hub datasets name them)."""
    if not path.name.endswith(tuple(f".json{zip_}" for zip_ in ("", *COMPRESSED))):
        return False
    with _open_binary(path) as raw:
        head = raw.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n")
    return head.startswith(b"[")


def _iter_json_array(path: Path, bad) -> Iterator[tuple[int, dict]]:
    with _open_binary(path) as raw:
        data = raw.read()
    try:
        records = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        try:
            data.decode("utf-8")
        except UnicodeDecodeError as encoding:  # named by its line, as in a JSON lines file
            start = data.rfind(b"\n", 0, encoding.start) + 1
            line = data[start:].split(b"\n", 1)[0]
            at = encoding.start - start
            problem = UnicodeDecodeError("utf-8", line, at, at + 1, encoding.reason)
            raise _not_utf8(path, data.count(b"\n", 0, start) + 1, line, problem) from None
        raise InputError(path, None, f"malformed JSON ({exc})", "the file must be one JSON array") from None
    for index, obj in enumerate(records, start=1):
        if isinstance(obj, dict):
            yield index, obj
        elif bad is None:
            raise InputError(path, index, "expected a JSON object", "make every array item an object")
        else:
            bad(index, f"expected a JSON object, got {type(obj).__name__}")


def _arrow_batches(path: Path):
    """An Arrow file's record batches, memory-mapped: `datasets` writes the IPC stream format (its
    ArrowWriter's RecordBatchStreamWriter); pyarrow and Feather v2 write the IPC file format, read as
    `datasets`' own arrow builder reads both."""
    import pyarrow as pa

    source = pa.memory_map(str(path))
    try:
        batches = pa.ipc.open_stream(source)
    except pa.ArrowInvalid:
        source.seek(0)
        reader = pa.ipc.open_file(source)
        batches = (reader.get_batch(index) for index in range(reader.num_record_batches))
    yield from batches


def _iter_rows(batches) -> Iterator[tuple[int, dict]]:
    row = 0
    for batch in batches:
        for obj in batch.to_pylist():
            row += 1
            yield row, without_nulls(obj)


def without_nulls(value):
    """A columnar row as the JSON record it holds: a table gives every row every column (and every
    struct every field any row had), null where the record had no such key; those keys are left out."""
    if isinstance(value, dict):
        return {k: without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [without_nulls(v) for v in value]
    return value
