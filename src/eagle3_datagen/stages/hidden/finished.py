"""A finished shard's second name: what a rerun Snakemake forces restores instead of capturing again.

A retried or requeued group job runs its shard jobs again with `--force` (Snakemake's remote job command), and
Snakemake removes each job's output before it runs: the shards the failed attempt had finished would be
captured again. So a finished shard's files are also linked (no byte copied) into its sibling
`.<shard>.finished/` with the fingerprint of what shaped its states (the capture's output settings: model,
layers, dtype, storage; and its token shard's bytes). A job whose fingerprint matches and whose parts still
match index.json's checksums links them back and captures nothing; any other job captures. Releasing the
shard (hidden_states.keep_shards: false) removes the second name with the parts; deleting the partition's
hidden/ folder removes it too.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path

from eagle3_datagen.formats.checksums import ALGORITHM, file_digest
from eagle3_datagen.formats.files import atomic_dir, read_json, write_json
from eagle3_datagen.formats.released import finished_copy

log = logging.getLogger(__name__)

FINGERPRINT = "fingerprint.json"


def states_fingerprint(settings: dict, tokens: str | Path) -> str:
    """What shapes a shard's states: the capture's output settings (the rule's params, without its run-only
    ones) and the bytes of its token shard."""
    shaped_by = json.dumps({"settings": settings, "tokens": file_digest(Path(tokens))}, sort_keys=True)
    return hashlib.sha256(shaped_by.encode()).hexdigest()


def keep_finished(out_dir: str | Path, fingerprint: str) -> Path:
    """Link a finished shard's files into its `.finished` copy, replacing an older one, beside `fingerprint`."""
    out_dir = Path(out_dir)
    copy = finished_copy(out_dir)
    work = copy.with_name(f"{copy.name}.linking")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    for path in out_dir.iterdir():
        if path.is_file() and not path.name.startswith("."):  # not Snakemake's own .snakemake_timestamp
            (work / path.name).hardlink_to(path)
    write_json(work / FINGERPRINT, {"fingerprint": fingerprint})
    shutil.rmtree(copy, ignore_errors=True)
    os.replace(work, copy)
    return copy


def restore_finished(out_dir: str | Path, fingerprint: str) -> bool:
    """Link the `.finished` copy back into `out_dir` where it was shaped by `fingerprint` and its parts match
    index.json's checksums; False (capture) otherwise."""
    out_dir = Path(out_dir)
    copy = finished_copy(out_dir)
    if not (copy / FINGERPRINT).is_file() or read_json(copy / FINGERPRINT)["fingerprint"] != fingerprint:
        return False
    index = read_json(copy / "index.json")
    for part in index["parts"]:
        path = copy / part["file"]
        if not path.is_file() or file_digest(path) != part[ALGORITHM]:
            log.warning("%s: its finished copy's %s does not match index.json: capturing it again", out_dir, path.name)
            return False
    with atomic_dir(out_dir) as tmp:
        for path in copy.iterdir():
            if path.name != FINGERPRINT:
                (tmp / path.name).hardlink_to(path)
    log.info(
        "%s: restored from %s (%d parts, %d tokens): nothing captured",
        out_dir,
        copy,
        len(index["parts"]),
        index["tokens"],
    )
    return True
