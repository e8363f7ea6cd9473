"""Checksums of what the workflow writes: xxh3-64 over a file's bytes, computed from the bytes as
they are written (never a second pass) and checked by every reader before it uses a byte.

xxh3 hashes at memory speed (tens of GB/s), so checking a part costs far less than decompressing
or copying it; it guards against bad disks, partial copies and bit flips, not against tampering.
"""

from __future__ import annotations

from pathlib import Path

import xxhash

ALGORITHM = "xxh3_64"
CHUNK = 16 << 20


class ChecksumError(ValueError):
    """A file whose bytes differ from the checksum recorded when it was written."""


def digest(data: bytes | memoryview) -> str:
    return xxhash.xxh3_64_hexdigest(data)


def file_digest(path: str | Path) -> str:
    hasher = xxhash.xxh3_64()
    with Path(path).open("rb") as f:
        while chunk := f.read(CHUNK):
            hasher.update(chunk)
    return hasher.hexdigest()


def check(path: str | Path, expected: str | None, actual: str, where: str, fix: str) -> None:
    """Raise unless `actual` (the digest of `path` as read) is the `expected` one recorded in `where`."""
    if expected is None:
        raise ChecksumError(f"{path}: no {ALGORITHM} checksum recorded in {where} (written before checksums); {fix}")
    if actual != expected:
        raise ChecksumError(
            f"{path}: {ALGORITHM} checksum {actual} does not match {expected} recorded in {where}: the file was "
            f"damaged after it was written (disk, copy or transfer); {fix}"
        )
