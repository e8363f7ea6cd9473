"""A partition's `source` as users hold it -> the files that hold its records, and the records.

- a file: JSON lines or a JSON array (plain, .gz, .bz2, .xz, .zst), Parquet, or Arrow (files.iter_records);
- a glob of such files (`data/train-*.parquet`), read in name order;
- a directory: a `datasets` `save_to_disk` dataset (a DatasetDict's `split`), or data files laid out as
  on the Hugging Face hub (a snapshot: `data/train-00000-of-00002.parquet`, a subset's folder, a
  README's `configs`), whose subset and split `datasets` resolves to files as `load_dataset` would;
- `hf:owner/name`: that dataset's snapshot in the local Hugging Face cache (huggingface_hub's layout:
  `datasets--owner--name/refs/<revision>` names the commit, `snapshots/<commit>/` holds its files), at
  `revision`; where the machine has a network and the cache lacks it, it is downloaded there first.

The hub's files are read one by one, not through `load_dataset`'s Arrow conversion: that gives every
JSON record the keys of all the others (null where it had none), which would read one layout's record
as another's. Each record keeps the file and the record number it came from.
"""

from __future__ import annotations

import glob
import os
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from eagle3_datagen.formats.files import InputError, iter_records, without_nulls

HUB_PREFIX = "hf:"
SAVED_BATCH = 4096


@dataclass(frozen=True)
class Source:
    """A partition's source settings: `subset` and `split` pick a hub dataset's or a snapshot
    directory's files (`split` also a saved DatasetDict's split); `revision` a hub dataset's commit."""

    source: str
    subset: str | None = None
    split: str | None = None
    revision: str | None = None


@dataclass
class Resolved:
    """The files (or saved datasets' directories) that hold a source's records, in reading order."""

    parts: list[str]
    saved: bool = False  # the parts are `save_to_disk` directories
    commit: str | None = None  # a hub dataset's commit


def is_hub(source: str) -> bool:
    return str(source).startswith(HUB_PREFIX)


def is_glob(source: str) -> bool:
    return not is_hub(source) and glob.has_magic(str(source))


def glob_files(pattern: str) -> list[str]:
    return sorted(p for p in glob.glob(pattern, recursive=True) if os.path.isfile(p))


def hub_repo(source: str) -> str:
    return str(source).removeprefix(HUB_PREFIX)


def hub_commit(repo: str, revision: str | None = None) -> str:
    """The commit `revision` (default: main) names: from the local cache's refs, else, with a network,
    from the hub. Reads no data file: cheap enough for every parse of the workflow."""
    from huggingface_hub import HfApi, constants, snapshot_download
    from huggingface_hub.errors import HFValidationError, IncompleteSnapshotError, LocalEntryNotFoundError

    try:
        snapshot = snapshot_download(repo, repo_type="dataset", revision=revision, local_files_only=True)
        return Path(snapshot).name
    except HFValidationError as exc:
        raise InputError(f"{HUB_PREFIX}{repo}", None, f"not a dataset id ({exc})", "use hf:owner/name") from None
    except LocalEntryNotFoundError as exc:
        if constants.HF_HUB_OFFLINE:
            incomplete = f" ({exc})" if isinstance(exc, IncompleteSnapshotError) else ""
            raise InputError(
                f"{HUB_PREFIX}{repo}",
                None,
                f"revision {revision or 'main'!r} is not in the Hugging Face cache ({constants.HF_HUB_CACHE}) "
                f"and HF_HUB_OFFLINE is set{incomplete}",
                f"download it where there is a network (`hf download --repo-type dataset {repo}"
                f"{f' --revision {revision}' if revision else ''}`) into that cache (HF_HUB_CACHE), or unset "
                "HF_HUB_OFFLINE",
            ) from None
    try:
        return HfApi().dataset_info(repo, revision=revision).sha
    except Exception as exc:  # the hub's errors (not found, gated, no network) all name the same fix
        raise InputError(
            f"{HUB_PREFIX}{repo}",
            None,
            f"cannot resolve revision {revision or 'main'!r} on the hub ({type(exc).__name__}: {exc})",
            "check the dataset id and revision (and HF_TOKEN for a gated dataset), or download it into the "
            f"Hugging Face cache first (`hf download --repo-type dataset {repo}`)",
        ) from None


def hub_snapshot(repo: str, commit: str) -> Path:
    """The snapshot directory of `commit` in the local cache, downloaded there first if it is missing
    and the machine has a network."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo, repo_type="dataset", revision=commit, local_files_only=True))
    except LocalEntryNotFoundError:
        if constants.HF_HUB_OFFLINE:
            raise InputError(
                f"{HUB_PREFIX}{repo}",
                None,
                f"commit {commit} is not in the Hugging Face cache ({constants.HF_HUB_CACHE})",
                f"download it (`hf download --repo-type dataset {repo} --revision {commit}`) or unset HF_HUB_OFFLINE",
            ) from None
    return Path(snapshot_download(repo, repo_type="dataset", revision=commit))


def resolve(source: Source) -> Resolved:
    """The files a source's records are read from; InputError naming the fix when there are none."""
    name = source.source
    if is_hub(name):
        repo = hub_repo(name)
        commit = hub_commit(repo, source.revision)
        resolved = _directory(hub_snapshot(repo, commit), source, name)
        resolved.commit = commit
        return resolved
    if is_glob(name):
        files = glob_files(name)
        if not files:
            raise InputError(name, None, "the pattern matches no file", "check the partition's `source` pattern")
        return Resolved(files)
    path = Path(name)
    if path.is_dir():
        return _directory(path, source, name)
    if not path.exists():
        raise InputError(name, None, "file not found", "check the partition's `source` path")
    return Resolved([name])


def _directory(path: Path, source: Source, name: str) -> Resolved:
    from datasets import config as ds_config

    if (path / ds_config.DATASETDICT_JSON_FILENAME).exists():
        from datasets import load_from_disk

        splits = list(load_from_disk(str(path)))
        split = _pick_split(splits, source.split, name, "saved DatasetDict")
        return Resolved([str(path / split)], saved=True)
    if (path / ds_config.DATASET_STATE_JSON_FILENAME).exists():
        return Resolved([str(path)], saved=True)
    return Resolved(_data_files(path, source, name))


def _data_files(path: Path, source: Source, name: str) -> list[str]:
    """The files of the subset's split as `datasets` lays a dataset directory out (load_dataset's own
    resolution: the README's `configs`, then `data/` and split-named files or folders)."""
    from datasets import load_dataset_builder

    with tempfile.TemporaryDirectory(prefix="e3dg-datasets-") as cache:  # the builder's lock files only
        try:
            builder = load_dataset_builder(str(path), name=source.subset, cache_dir=cache)
        except ValueError as exc:  # datasets' word on the subsets: one is missing, or none was named
            problem = f"the dataset has no subset {source.subset!r}" if source.subset else "no subset named"
            raise InputError(
                name, None, f"{problem} ({' '.join(str(exc).split())})", "set the partition's `subset` to one it has"
            ) from None
        except FileNotFoundError as exc:
            raise InputError(
                name,
                None,
                f"`datasets` finds no dataset here ({type(exc).__name__}: {exc})",
                "point `source` at a data file, a directory of them, a `save_to_disk` directory or a hub "
                "snapshot; a dataset with several subsets needs the partition's `subset`",
            ) from None
    data_files = builder.config.data_files or {}
    split = _pick_split(list(data_files), source.split, name, f"dataset (subset {builder.config.name!r})")
    return [str(f) for f in data_files[split]]


def _pick_split(splits: list[str], split: str | None, name: str, what: str) -> str:
    if split is not None and split in splits:
        return split
    if split is None and len(splits) == 1:
        return splits[0]
    problem = f"the {what} has splits {sorted(splits)}" + (f", not {split!r}" if split else "")
    raise InputError(name, None, problem, "set the partition's `split` to one of them")


def iter_source(
    resolved: Resolved, bad: Callable[[str, int, str], None] | None = None
) -> Iterator[tuple[str, int, dict]]:
    """(file, record number, record) of every record, in the parts' order; a record that is not an
    object goes to `bad(file, number, reason)` when given."""
    for part in resolved.parts:
        if resolved.saved:
            yield from ((part, number, record) for number, record in _iter_saved(part))
        else:
            on_bad = None if bad is None else (lambda number, reason, part=part: bad(part, number, reason))
            yield from ((part, number, record) for number, record in iter_records(part, on_bad))


def _iter_saved(path: str) -> Iterator[tuple[int, dict]]:
    """A `save_to_disk` dataset's rows, memory-mapped by `datasets` and read a batch at a time."""
    from datasets import load_from_disk

    row = 0
    for table in load_from_disk(path).with_format("arrow").iter(batch_size=SAVED_BATCH):
        for record in table.to_pylist():
            row += 1
            yield row, without_nulls(record)
