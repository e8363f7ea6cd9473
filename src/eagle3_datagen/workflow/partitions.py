"""The run's partitions: the configured ones and their baseline twins, their shards and backends, and
their sources as the prompts rule reads them (input files, hub commits)."""

from __future__ import annotations

import functools
import os
from pathlib import Path

from eagle3_datagen.backends.plugins import DATASET, GENERATION
from eagle3_datagen.formats import sources
from eagle3_datagen.formats.files import InputError

BASELINE_SUFFIX = "+original"


def baseline_partition(partition: str) -> str:
    """The partition trained on `partition`'s own dataset responses (`evaluate.baseline: original`). The
    schema's partition names hold no `+`, so no user partition has this name."""
    return partition + BASELINE_SUFFIX


def baseline_partitions(config: dict) -> list[str]:
    """One baseline partition per partition when `evaluate.baseline` is `original`, else none."""
    if "evaluate" not in config or config["evaluate"]["baseline"] != "original":
        return []
    return [baseline_partition(p) for p in sorted(config["partitions"])]


def prompt_partition(partition: str) -> str:
    """The partition whose prompt shards `partition` answers: a baseline partition its own partition's."""
    return partition.removesuffix(BASELINE_SUFFIX)


def partition_config(config: dict, partition: str) -> dict:
    """A partition's settings; a baseline partition's are its partition's with the `dataset` backend."""
    if partition in config["partitions"]:
        return config["partitions"][partition]
    if partition in baseline_partitions(config):
        return {**config["partitions"][prompt_partition(partition)], "backend": DATASET}
    raise KeyError(f"no partition {partition!r} in the config")


def shard_names(config: dict, partition: str) -> list[str]:
    return [f"{i:05d}" for i in range(partition_config(config, partition)["shards"])]


def inference_backend(config: dict, partition: str) -> str:
    # a partition without a backend of its own takes inference.backend
    return partition_config(config, partition).get("backend") or config["inference"]["backend"]


def served_by_launched_server(config: dict, partition: str) -> bool:
    """Partitions whose responses come from a server the workflow launches for them (their backend's
    node service)."""
    return GENERATION[inference_backend(config, partition)].served(config)


def launched_backends(config: dict) -> dict[str, list[str]]:
    """The backends whose server the workflow launches, each with the partitions it answers (two take turns
    on a node: it holds one service at a time, backends/service/)."""
    served: dict[str, list[str]] = {}
    for partition in sorted(config["partitions"]):
        if served_by_launched_server(config, partition):
            served.setdefault(inference_backend(config, partition), []).append(partition)
    return served


def earlier_partitions(config: dict, partition: str) -> list[str]:
    """The partitions whose prompts `partition` leaves out: those before it in name order, when
    `prompts.shared_across_partitions` is `drop`; none when it is `keep` (the default)."""
    if config["prompts"]["shared_across_partitions"] != "drop":
        return []
    return [p for p in sorted(config["partitions"]) if p < partition]


def source_is_input(source: str) -> bool:
    """A file source is the prompts rule's input and its command's --source; a glob's, a directory's and
    a hub dataset's `source` is in the rule's settings."""
    return not (sources.is_hub(source) or sources.is_glob(source) or Path(source).is_dir())


def source_inputs(config: dict, partition: str) -> list[str]:
    """The prompts rule's source inputs: the file, a glob's files, every file in a directory (so one
    rewritten in place reruns the partition, which the directory's own time would not show; hidden
    ones, such as a download's `.cache/`, left out), none for a hub dataset."""
    source = config["partitions"][partition]["source"]
    if sources.is_hub(source):
        return []
    if sources.is_glob(source):
        return sources.glob_files(source)
    if Path(source).is_dir():
        files = []
        for root, dirs, names in os.walk(source):
            dirs[:] = [d for d in dirs if not d.startswith(".")]
            files += [os.path.join(root, name) for name in names if not name.startswith(".")]
        return sorted(files)
    return [source]


@functools.cache
def hub_commit_or_error(repo: str, revision: str | None) -> str | InputError:
    try:
        return sources.hub_commit(repo, revision)
    except InputError as error:
        return error


def source_commits(config: dict) -> dict[str, str]:
    """Each hub-dataset partition's commit, its revision resolved from the Hugging Face cache's refs
    (or the hub, with a network, when the cache lacks it); missing_sources reports those that fail."""
    commits = {}
    for name, part in config["partitions"].items():
        if sources.is_hub(part["source"]):
            commit = hub_commit_or_error(sources.hub_repo(part["source"]), part.get("revision"))
            if isinstance(commit, str):
                commits[name] = commit
    return commits
