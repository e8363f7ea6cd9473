"""The files of one export, each hashed from the bytes as written."""

from __future__ import annotations

import threading
from pathlib import Path

from eagle3_datagen.formats.checksums import digest, file_digest


class ExportFiles:
    """Writes files under an export directory and keeps the checksum and size of each one (from any thread)."""

    def __init__(self, root: Path):
        self.root = root
        self.checksums: dict[str, str] = {}
        self.sizes: dict[str, int] = {}
        self._lock = threading.Lock()

    @property
    def bytes(self) -> int:
        return sum(self.sizes.values())

    def write(self, relative: str, data: bytes) -> None:
        path = self.root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        self._keep(relative, digest(data), len(data))

    def link(self, relative: str, source: Path, checksum: str) -> None:
        """`source` (a kept copy's file, whose checksum its export.json records) linked in: no byte is copied."""
        path = self.root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.hardlink_to(source)
        self._keep(relative, checksum, path.stat().st_size)

    def record(self, relative: str) -> None:
        """A file another library wrote (the Arrow dataset: ids and masks only, small)."""
        path = self.root / relative
        self._keep(relative, file_digest(path), path.stat().st_size)

    def _keep(self, relative: str, checksum: str, size: int) -> None:
        with self._lock:
            self.checksums[relative] = checksum
            self.sizes[relative] = size
