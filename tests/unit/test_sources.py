"""Sources as users hold them: the real records of tests/fixtures/realdata, written in each layout by the
library that makes it (`datasets`: its Arrow cache files, save_to_disk, to_parquet; huggingface_hub's
cache layout), give the same prompts (ids, turns, tools) as the JSON lines they were written from."""

import bz2
import gzip
import json
import lzma
from collections import Counter
from pathlib import Path

import datasets
import pyarrow.feather as feather
import pytest
import zstandard

from eagle3_datagen.config_schema import fill_defaults
from eagle3_datagen.formats.datasets import normalize
from eagle3_datagen.formats.files import InputError, read_jsonl
from eagle3_datagen.formats.sources import Source
from eagle3_datagen.stages.prompts import build_prompts
from tests.helpers.records import ALPACA, MANIFEST, OPENAI, REALDATA, SHAREGPT, TOOLS, as_dataset, hub_cache, hub_layout

datasets.disable_progress_bars()


def prompts(source, fmt: str, stats: Counter | None = None) -> list[tuple]:
    """(id, messages, tools) of every prompt, in source order."""
    found = normalize(source, fmt, None, Counter() if stats is None else stats)
    return [(p["id"], p["messages"], p.get("tools")) for p in found]


def expected(name: str) -> list[tuple]:
    return prompts(REALDATA / name, dict(MANIFEST)[name])


def test_compressed_json_lines_and_arrays_give_the_jsonl_prompts(tmp_path):
    compressors = {"gz": gzip.compress, "bz2": bz2.compress, "xz": lzma.compress}
    compressors["zst"] = zstandard.ZstdCompressor().compress
    for name, fmt in MANIFEST:
        text = (REALDATA / name).read_bytes()
        want = expected(name)
        for suffix, compress in compressors.items():
            path = tmp_path / f"{name}.{suffix}"
            path.write_bytes(compress(text))
            assert prompts(path, fmt) == want, path.name
        # a .json file of JSON lines (as many hub datasets name them), and a gzipped JSON array
        (tmp_path / "lines.json").write_bytes(text)
        array = json.dumps([json.loads(line) for line in text.splitlines() if line.strip()]).encode()
        (tmp_path / "array.json.gz").write_bytes(gzip.compress(array))
        assert prompts(tmp_path / "lines.json", fmt) == want == prompts(tmp_path / "array.json.gz", fmt), name


def test_arrow_files_as_datasets_and_pyarrow_write_them_give_the_jsonl_prompts(tmp_path):
    """`datasets` writes the IPC stream format (its cache's .arrow files); pyarrow's Feather v2 the IPC
    file format. Both fill a record's missing keys with nulls, which are read as missing again."""
    for name, fmt in MANIFEST:
        dataset = as_dataset(name, tmp_path / "cache")
        cache_file = Path(dataset.cache_files[0]["filename"])
        assert cache_file.suffix == ".arrow" and cache_file.read_bytes()[:6] != b"ARROW1"  # a stream
        feather.write_feather(dataset.data.table, tmp_path / "file.arrow", compression="uncompressed")
        assert (tmp_path / "file.arrow").read_bytes()[:6] == b"ARROW1"
        want = expected(name)
        assert prompts(cache_file, fmt) == want, name
        assert prompts(tmp_path / "file.arrow", fmt) == want, name


def test_save_to_disk_directories_give_the_jsonl_prompts_and_a_dataset_dict_needs_its_split(tmp_path):
    for name in (SHAREGPT, OPENAI, ALPACA, TOOLS):
        fmt = dict(MANIFEST)[name]
        dataset = as_dataset(name, tmp_path / "cache")
        dataset.save_to_disk(tmp_path / name / "saved")
        datasets.DatasetDict({"train": dataset, "test": dataset.select([0])}).save_to_disk(tmp_path / name / "dict")
        want = expected(name)
        assert prompts(tmp_path / name / "saved", fmt) == want, name
        assert prompts(Source(str(tmp_path / name / "dict"), split="train"), fmt) == want, name
        assert prompts(Source(str(tmp_path / name / "dict"), split="test"), fmt) == want[:1], name
    with pytest.raises(
        InputError, match=r"saved DatasetDict has splits \['test', 'train'\]. Fix: set the partition's `split`"
    ):
        prompts(tmp_path / ALPACA / "dict", "alpaca")


def test_hub_snapshot_directories_and_globs_of_their_shards_give_the_jsonl_prompts(tmp_path):
    snapshot = hub_layout(tmp_path / "snapshot", [TOOLS, ALPACA], tmp_path / "cache")
    tools, alpaca = expected(TOOLS), expected(ALPACA)
    stats = Counter()
    assert prompts(Source(str(snapshot), split="train"), "sharegpt", stats) == tools
    assert stats["records"] == 302
    assert prompts(Source(str(snapshot), subset="subset1", split="train"), "alpaca") == alpaca
    assert prompts(str(snapshot / "data" / "train-*.parquet"), "sharegpt") == tools
    with pytest.raises(InputError, match=r"has splits \['test', 'train'\]. Fix: set the partition's `split`"):
        prompts(str(snapshot), "sharegpt")
    with pytest.raises(
        InputError, match=r"has no subset 'nosuch' \(BuilderConfig .* Available: \['default', 'subset1'\]\)"
    ):
        prompts(Source(str(snapshot), subset="nosuch", split="train"), "sharegpt")
    (snapshot / "README.md").write_text(
        (snapshot / "README.md").read_text().replace("config_name: default", "config_name: other")
    )
    with pytest.raises(
        InputError,
        match=r"no subset named \(Config name is missing\. Please pick one among the available configs: "
        r"\['other', 'subset1'\].* Fix: set the partition's `subset`",
    ):
        prompts(Source(str(snapshot), split="train"), "sharegpt")
    # a directory of plain data files, one split
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "a.jsonl.gz").write_bytes(gzip.compress((REALDATA / ALPACA).read_bytes()))
    assert prompts(tmp_path / "plain", "alpaca") == alpaca


def test_sharegpt_turns_of_role_and_content_and_openai_turns_of_from_and_value_are_read_as_such(tmp_path):
    roles = {"human": "user", "gpt": "assistant", "system": "system"}
    sharegpt = [
        {**r, "conversations": [{"role": roles[t["from"]], "content": t["value"]} for t in r["conversations"]]}
        for r in read_jsonl(REALDATA / SHAREGPT)
    ]
    froms = {v: k for k, v in roles.items()}
    openai = [
        {**r, "messages": [{"from": froms[m["role"]], "value": m["content"]} for m in r["messages"]]}
        for r in read_jsonl(REALDATA / OPENAI)
    ]
    for rows, name, fmt in ((sharegpt, SHAREGPT, "sharegpt"), (openai, OPENAI, "openai")):
        path = tmp_path / f"swapped-{name}"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        for read_as in (fmt, "auto"):
            stats = Counter()
            assert prompts(path, read_as, stats) == expected(name), (name, read_as)
            assert not any(k.startswith(("skipped_", "bad_")) for k in stats), stats
            turns_key = (
                "conversations_turns_read_as_role_content" if fmt == "sharegpt" else "messages_turns_read_as_from_value"
            )
            assert stats[turns_key] == len(rows)


def test_auto_counts_the_layout_it_read_each_record_as_and_the_unknown_ones(tmp_path):
    rows = [*read_jsonl(REALDATA / SHAREGPT), *read_jsonl(REALDATA / OPENAI), *read_jsonl(REALDATA / ALPACA)[:3]]
    source = tmp_path / "mixed.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in [*rows, {"prompt": "a layout no parser knows"}]))
    stats = build_prompts(source, "auto", [tmp_path / "0.jsonl.zst"], tmp_path / "s.json", max_bad_record_rate=0.2)
    assert stats["detected_layouts"] == {"sharegpt": 2, "openai": 1, "alpaca": 3, "unknown": 1}
    assert stats["prompts"] == 6 and stats["bad_records"] == 1
    explicit = build_prompts(REALDATA / ALPACA, "alpaca", [tmp_path / "1.jsonl.zst"], tmp_path / "t.json")
    assert "detected_layouts" not in explicit  # counted only where the layout is detected


def test_a_malformed_line_is_a_bad_record_within_the_rate_and_an_encoding_error_names_the_fix(tmp_path):
    lines = (REALDATA / ALPACA).read_text().splitlines()[:3]
    source = tmp_path / "broken.jsonl"
    source.write_text("\n".join([lines[0], '{"instruction": "cut off', *lines[1:]]) + "\n")
    stats = build_prompts(source, "alpaca", [tmp_path / "0.jsonl.zst"], tmp_path / "s.json", max_bad_record_rate=0.3)
    assert stats["prompts"] == 3 and stats["records"] == 4 and stats["bad_records"] == 1
    assert stats["bad_record_examples"][0]["line"] == 2
    assert stats["bad_record_examples"][0]["reason"].startswith("malformed JSON")
    latin1 = tmp_path / "latin1.jsonl"
    latin1.write_bytes(
        lines[0].encode() + b"\n" + json.dumps({"instruction": "caf\u00e9"}, ensure_ascii=False).encode("latin-1")
    )
    with pytest.raises(
        InputError,
        match=r"latin1\.jsonl:2: the file's encoding is not UTF-8 \(byte 0xe9 at position 21 of the line\); Latin-1"
        r".* Fix: convert it, e\.g\. `iconv -f latin1 -t utf-8 latin1\.jsonl > latin1\.jsonl\.utf8`",
    ):
        build_prompts(latin1, "alpaca", [tmp_path / "1.jsonl.zst"], tmp_path / "t.json")
    utf16 = tmp_path / "utf16.jsonl"
    utf16.write_bytes("\n".join(lines).encode("utf-16"))  # as Windows tools save "Unicode" text
    with pytest.raises(InputError, match=r"utf16\.jsonl:1: the file's encoding is UTF-16 .* `iconv -f utf-16 -t utf-8"):
        build_prompts(utf16, "alpaca", [tmp_path / "1.jsonl.zst"], tmp_path / "t.json")


def test_a_partition_without_prompts_fails_with_its_reason_unless_it_may_be_empty(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    shard, stats = tmp_path / "0.jsonl.zst", tmp_path / "s.json"
    with pytest.raises(
        InputError, match=r"empty\.jsonl: no prompts: .*empty\.jsonl holds no record. Fix: .*allow_empty: true"
    ):
        build_prompts(empty, "sharegpt", [shard], stats)
    assert not shard.exists() and not stats.exists()
    unknown_roles = tmp_path / "roles.jsonl"
    unknown_roles.write_text(json.dumps({"conversations": [{"from": "narrator", "value": "Once"}]}) + "\n")
    with pytest.raises(
        InputError,
        match=r"no prompts: 1 records read from .*roles\.jsonl, all left out \(skipped_unknown_role: 1\)\. "
        r"Fix: set the partition's `format`",
    ):
        build_prompts(unknown_roles, "sharegpt", [shard], stats)
    written = build_prompts(empty, "sharegpt", [shard], stats, allow_empty=True)
    assert written["prompts"] == 0 and read_jsonl(shard) == []


@pytest.fixture
def offline_cache(tmp_path, monkeypatch):
    from huggingface_hub import constants

    cache = tmp_path / "hf-cache"
    cache.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


def test_a_hub_dataset_is_read_from_the_local_cache_at_its_revisions_commit(tmp_path, offline_cache):
    from huggingface_hub import scan_cache_dir

    snapshot = hub_layout(tmp_path / "repo", [TOOLS, ALPACA], tmp_path / "cache")
    commit = hub_cache(offline_cache, "owner/chats", snapshot)
    (cached,) = scan_cache_dir(offline_cache).repos  # huggingface_hub reads the cache as one it wrote
    assert cached.repo_id == "owner/chats" and cached.repo_type == "dataset"
    assert {r.commit_hash for r in cached.revisions} == {commit} and cached.refs.keys() == {"main"}
    stats = build_prompts(
        Source("hf:owner/chats", split="train"), "sharegpt", [tmp_path / "0.jsonl.zst"], tmp_path / "s.json"
    )
    assert stats["commit"] == commit and stats["source"] == "hf:owner/chats"
    assert stats["files"][0].endswith(f"snapshots/{commit}/data/train-00000-of-00002.parquet")
    written = sorted(read_jsonl(tmp_path / "0.jsonl.zst"), key=lambda p: (p["source"]["file"], p["source"]["line"]))
    ids, unique = set(), []  # the first prompt of each id, as the stage keeps it
    for prompt in expected(TOOLS):
        if prompt[0] not in ids:
            ids.add(prompt[0])
            unique.append(prompt)
    assert [(p["id"], p["messages"], p.get("tools")) for p in written] == unique
    assert stats["duplicates"] == 302 - len(unique) == 36
    subset = Source("hf:owner/chats", subset="subset1", split="train", revision=commit)
    assert prompts(subset, "alpaca") == expected(ALPACA)
    with pytest.raises(
        InputError,
        match=r"hf:owner/chats: revision 'v2' is not in the Hugging Face cache .* and HF_HUB_OFFLINE is set\. "
        r"Fix: download it .*`hf download --repo-type dataset owner/chats --revision v2`",
    ):
        prompts(Source("hf:owner/chats", split="train", revision="v2"), "sharegpt")


def test_the_workflow_checks_sources_and_puts_a_hub_datasets_commit_in_the_prompts_params(
    tmp_path, offline_cache, monkeypatch
):
    from eagle3_datagen.workflow import config_checks
    from eagle3_datagen.workflow import partitions as parts
    from eagle3_datagen.workflow import settings as wf

    snapshot = hub_layout(tmp_path / "repo", [ALPACA], tmp_path / "cache")
    commit = hub_cache(offline_cache, "owner/chats", snapshot)
    parts.hub_commit_or_error.cache_clear()
    monkeypatch.chdir(tmp_path)
    config = fill_defaults(
        {
            "partitions": {
                "hub": {"source": "hf:owner/chats", "format": "alpaca", "shards": 1, "split": "train"},
                "shards": {"source": "repo/data/train-*.parquet", "format": "alpaca", "shards": 1},
                "dir": {"source": "repo", "format": "alpaca", "shards": 1, "split": "train", "revision": "main"},
                "none": {"source": "repo/nothing-*.jsonl", "format": "alpaca", "shards": 1},
                "csv": {"source": "repo/README.md", "format": "alpaca", "shards": 1},
                "gone": {"source": "hf:owner/gone", "format": "alpaca", "shards": 1},
                "id": {"source": "hf:not an id", "format": "alpaca", "shards": 1},
            }
        }
    )
    problems = config_checks.missing_sources(config, ["c.yaml"])
    assert [p.split(":")[0] for p in problems] == [
        "partition 'csv'",
        "partition 'dir'",
        "partition 'gone'",
        "partition 'id'",
        "partition 'none'",
    ]
    assert "is of no type the prompts stage reads" in problems[0]
    assert "`revision` applies to a hub dataset (hf:owner/name), not to source 'repo'" in problems[1]
    assert "hf download --repo-type dataset owner/gone" in problems[2] and "matches no file" in problems[4]
    assert "hf:not an id: not a dataset id (Repo id must use" in problems[3] and "Fix: use hf:owner/name" in problems[3]
    assert parts.source_commits(config) == {"hub": commit}
    assert parts.source_inputs(config, "hub") == []
    assert parts.source_inputs(config, "dir") == [
        "repo/README.md",
        "repo/data/test-00000-of-00001.parquet",
        "repo/data/train-00000-of-00002.parquet",
        "repo/data/train-00001-of-00002.parquet",
    ]
    assert parts.source_inputs(config, "shards") == [
        "repo/data/train-00000-of-00002.parquet",
        "repo/data/train-00001-of-00002.parquet",
    ]
    unset = {"system_prompt": None, "max_prompts": None, "subset": None, "max_bad_record_rate": 0}
    assert wf.prompt_settings(config, "hub", commit) == {
        **unset,
        "format": "alpaca",
        "source": "hf:owner/chats",
        "split": "train",
        "revision": None,
        "commit": commit,
        "allow_empty": False,
        "drop_shared_with": [],
    }
    assert wf.prompt_settings(config, "dir") == {
        **unset,
        "format": "alpaca",
        "source": "repo",
        "split": "train",
        "revision": "main",
        "commit": None,
        "allow_empty": False,
        "drop_shared_with": [],
    }
