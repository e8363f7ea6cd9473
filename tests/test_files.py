import os
import stat

import pytest

from eagle3_datagen.formats.files import atomic_dir, write_json, write_jsonl_zst


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
