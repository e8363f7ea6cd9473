"""The files of one export, each hashed from the bytes as written."""

from __future__ import annotations

from pathlib import Path

from eagle3_datagen.formats.checksums import digest, file_digest


class ExportFiles:
    """Writes files under an export directory and keeps the checksum of each one's bytes."""

    def __init__(self, root: Path):
        self.root = root
        self.checksums: dict[str, str] = {}

    def write(self, relative: str, data: bytes) -> None:
        path = self.root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        self.checksums[relative] = digest(data)

    def record(self, relative: str) -> None:
        """A file another library wrote (the Arrow dataset: ids and masks only, small)."""
        self.checksums[relative] = file_digest(self.root / relative)
