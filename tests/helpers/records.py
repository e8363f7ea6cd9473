"""Dataset records as the tests write them: a JSONL writer, a Glaive function-calling chain (two calls,
each with its recorded result), the real records of tests/fixtures/realdata, and the layouts `datasets`
and huggingface_hub give them (an Arrow cache file, a hub repository, a hub cache)."""

import json
from pathlib import Path

from tests.helpers import REPO


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


GLAIVE_FUNCTIONS = """SYSTEM: You are a helpful assistant with access to the following functions. Use them if required -
{
    "name": "calculate_factorial",
    "description": "Calculate the factorial of a given number",
    "parameters": {
        "type": "object",
        "properties": {
            "number": {
                "type": "integer",
                "description": "The number to calculate factorial for"
            }
        },
        "required": [
            "number"
        ]
    }
}

{
    "name": "get_news_headlines",
    "description": "Get the latest news headlines",
    "parameters": {
        "type": "object",
        "properties": {
            "country": {
                "type": "string"
            }
        }
    }
}
"""
GLAIVE_CHAIN = {
    "system": GLAIVE_FUNCTIONS,
    "chat": "USER: Hi, I need to calculate the factorial of 5. Can you help me with that?\n\n\n"
    'ASSISTANT: <functioncall> {"name": "calculate_factorial", "arguments": \'{"number": 5}\'} <|endoftext|>\n\n\n'
    'FUNCTION RESPONSE: {"result": 120}\n\n\n'
    "ASSISTANT: The factorial of 5 is 120. <|endoftext|>\n\n\n"
    "USER: And the news for the United States?\n\n\n"
    'ASSISTANT: <functioncall> {"name": "get_news_headlines", "arguments": \'{\n'
    '  "country": "United States"\n'
    "}'} <|endoftext|>\n\n\n"
    'FUNCTION RESPONSE: {"headlines": ["A", "B"]}\n\n\n'
    "ASSISTANT: Here are the headlines: A, B. <|endoftext|>\n\n\n"
    "USER: Thanks!\n\n\n"
    "ASSISTANT: You're welcome! <|endoftext|>",
}


REALDATA = REPO / "tests" / "fixtures" / "realdata"
MANIFEST = [line.split("\t")[:2] for line in (REALDATA / "manifest.tsv").read_text().splitlines()[1:]]
# One file of each turn layout, with tool definitions whose JSON differs from record to record.
SHAREGPT, OPENAI, ALPACA, TOOLS = (
    "sharegpt_vicuna.jsonl",
    "code_feedback.jsonl",
    "alpaca_llamafactory.jsonl",
    "glaive_toolcall_llamafactory.jsonl",
)


def as_dataset(name: str, cache: Path):
    """The file as `datasets` loads it: JSON lines into an Arrow file in its cache."""
    import datasets

    datasets.disable_progress_bars()
    return datasets.Dataset.from_json(str(REALDATA / name), cache_dir=str(cache))


def hub_layout(root: Path, names: list[str], cache: Path) -> Path:
    """A dataset repository as `push_to_hub` lays it out: the default subset's shards under data/
    (`train-00000-of-00002.parquet`), another subset's in its own folder, named by the README's configs."""
    for index, name in enumerate(names):
        dataset = as_dataset(name, cache)
        folder = root / ("data" if index == 0 else f"subset{index}")
        folder.mkdir(parents=True, exist_ok=True)
        for shard in range(2):
            part = dataset.shard(2, shard, contiguous=True)
            part.to_parquet(str(folder / f"train-{shard:05d}-of-00002.parquet"))
        dataset.select([0]).to_parquet(str(folder / "test-00000-of-00001.parquet"))
    configs = "".join(
        f"- config_name: {'default' if i == 0 else f'subset{i}'}\n  data_files:\n"
        f"  - split: train\n    path: {'data' if i == 0 else f'subset{i}'}/train-*\n"
        f"  - split: test\n    path: {'data' if i == 0 else f'subset{i}'}/test-*\n"
        for i in range(len(names))
    )
    (root / "README.md").write_text(f"---\nconfigs:\n{configs}---\n")
    return root


def hub_cache(cache: Path, repo: str, snapshot_from: Path, revision: str = "main") -> str:
    """Put a dataset repository's files into a Hugging Face cache as huggingface_hub lays one out
    (blobs by content hash, snapshots/<commit>/ linking to them, refs/<revision> naming the commit),
    through its own helpers, since a download is the only public way to fill one and tests have no
    network. Returns the commit."""
    import hashlib

    from huggingface_hub.file_download import (
        _cache_commit_hash_for_specific_revision,
        _create_symlink,
        repo_folder_name,
    )

    storage = cache / repo_folder_name(repo_id=repo, repo_type="dataset")
    files = sorted(p for p in snapshot_from.rglob("*") if p.is_file())
    commit = hashlib.sha1(b"".join(p.read_bytes() for p in files)).hexdigest()
    for path in files:
        blob = storage / "blobs" / hashlib.sha256(path.read_bytes()).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(path.read_bytes())
        link = storage / "snapshots" / commit / path.relative_to(snapshot_from)
        link.parent.mkdir(parents=True, exist_ok=True)
        _create_symlink(str(blob), str(link))
    _cache_commit_hash_for_specific_revision(str(storage), revision, commit)
    return commit
