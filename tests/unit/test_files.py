import os
import stat

import orjson
import pytest
import zstandard

from eagle3_datagen.formats.files import atomic_dir, read_jsonl, write_json, write_jsonl_zst


@pytest.fixture
def umask():
    """Set the process umask for one test, and restore it."""
    before = os.umask(0o022)
    yield os.umask
    os.umask(before)


@pytest.mark.parametrize(
    ("mask", "file_mode", "dir_mode"), [(0o022, 0o644, 0o755), (0o027, 0o640, 0o750)], ids=["022", "027"]
)
def test_outputs_follow_the_umask(tmp_path, umask, mask, file_mode, dir_mode):
    """Atomic outputs get the modes any file the user makes gets (readable by the group under 022),
    not tempfile's 0600/0700, and the umask's restrictions too."""
    umask(mask)
    write_json(tmp_path / "stats.json", {"prompts": 5})
    write_jsonl_zst(tmp_path / "00000.jsonl.zst", [{"id": "a"}])
    with atomic_dir(tmp_path / "export") as tmp:
        (tmp / "data.json").write_text("{}")
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in tmp_path.rglob("*")}
    assert modes == {"stats.json": file_mode, "00000.jsonl.zst": file_mode, "export": dir_mode, "data.json": file_mode}


def test_a_failed_write_leaves_nothing(tmp_path):
    with pytest.raises(RuntimeError), atomic_dir(tmp_path / "export") as tmp:
        (tmp / "half").write_text("x")
        raise RuntimeError("killed")
    assert list(tmp_path.iterdir()) == []


def test_a_zstd_file_of_several_frames_reads_whole(tmp_path):
    """A source compressed in parts (`cat a.zst b.zst`, pzstd) is one zstd frame per part; every row of
    every frame is read, in order, also where a frame ends inside the reader's buffer."""
    rows = [{"id": i, "text": f"row {i} " * (i % 7)} for i in range(6000)]
    frames = [
        zstandard.ZstdCompressor().compress(b"".join(orjson.dumps(r) + b"\n" for r in part))
        for part in (rows[:1], rows[1:3500], rows[3500:])
    ]
    (tmp_path / "parts.jsonl.zst").write_bytes(b"".join(frames))
    assert read_jsonl(tmp_path / "parts.jsonl.zst") == rows
    assert write_jsonl_zst(tmp_path / "written.jsonl.zst", rows) == len(rows)
    assert read_jsonl(tmp_path / "written.jsonl.zst") == rows
