import json
from collections import Counter

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from eagle3_datagen.io import InputError, read_jsonl
from eagle3_datagen.prompts import FORMATS, build_prompts, conversation_id, normalize, shard_of


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


SHAREGPT = {
    "id": "s1",
    "conversations": [
        {"from": "system", "value": "Be brief."},
        {"from": "human", "value": "Hi"},
        {"from": "gpt", "value": "Hello"},
        {"from": "human", "value": "Bye"},
        {"from": "gpt", "value": "Goodbye"},
    ],
}
OPENAI = {
    "messages": [
        {"role": "user", "content": [{"type": "text", "text": "What is 2+2?"}]},
        {"role": "assistant", "content": "4"},
    ]
}
ALPACA = {"instruction": "Reverse the word.", "input": "abc", "output": "cba"}
GLAIVE = {
    "system": "SYSTEM: You can call get_time.",
    "chat": 'USER: What time is it? ASSISTANT: <functioncall> {"name": "get_time"} <|endoftext|> '
    'FUNCTION RESPONSE: {"time": "10:00"} ASSISTANT: It is 10:00. <|endoftext|> USER: Thanks',
}


def test_each_format_normalizes_to_system_and_user_turns(tmp_path):
    stats = Counter()
    for fmt, record, expected in [
        ("sharegpt", SHAREGPT, [("system", "Be brief."), ("user", "Hi"), ("user", "Bye")]),
        ("openai", OPENAI, [("user", "What is 2+2?")]),
        ("alpaca", ALPACA, [("user", "Reverse the word.\n\nabc")]),
        # the conversation is cut before the tool result: it answers the original call
        ("glaive", GLAIVE, [("system", "You can call get_time."), ("user", "What time is it?")]),
    ]:
        src = write_jsonl(tmp_path / f"{fmt}.jsonl", [record])
        for chosen in (fmt, "auto"):
            [prompt] = list(normalize(src, chosen, None, stats))
            assert [(m["role"], m["content"]) for m in prompt["messages"]] == expected
            assert prompt["source"] == {
                "file": str(src),
                "line": 1,
                "format": fmt,
                **({"id": "s1"} if fmt == "sharegpt" else {}),
            }


def test_ids_are_stable_content_hashes_and_shards_follow_them():
    messages = [{"role": "user", "content": "Hi"}]
    assert conversation_id(messages) == conversation_id([dict(m) for m in messages])
    assert conversation_id(messages) != conversation_id([{"role": "user", "content": "Hi!"}])
    prompt_id = conversation_id(messages)
    assert shard_of(prompt_id, 7) == int(prompt_id, 16) % 7


def test_build_prompts_dedups_counts_skips_and_shards(tmp_path):
    rows = [
        SHAREGPT,
        dict(SHAREGPT, id="copy"),
        {"conversations": [{"from": "gpt", "value": "orphan"}]},
        {"conversations": [{"from": "human", "value": "Other"}]},
    ]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    outs = [tmp_path / f"{i}.jsonl.zst" for i in range(3)]
    stats = build_prompts(src, "sharegpt", outs, tmp_path / "stats.json", system_prompt="Default.")
    assert stats["records"] == 4
    assert stats["prompts"] == 2
    assert stats["duplicates"] == 1
    assert stats["skipped_no_user_turn"] == 1
    written = [p for out in outs for p in read_jsonl(out)]
    assert sorted(p["id"] for p in written) == sorted({conversation_id(p["messages"]) for p in written})
    for index, out in enumerate(outs):
        assert all(shard_of(p["id"], 3) == index for p in read_jsonl(out))
    other = next(p for p in written if p["messages"][-1]["content"] == "Other")
    assert other["messages"][0] == {"role": "system", "content": "Default."}
    assert json.loads((tmp_path / "stats.json").read_text())["per_shard"] == [len(read_jsonl(o)) for o in outs]


def test_max_prompts_caps_in_source_order(tmp_path):
    rows = [{"conversations": [{"from": "human", "value": f"q{i}"}]} for i in range(5)]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    stats = build_prompts(src, "sharegpt", [tmp_path / "0.jsonl.zst"], tmp_path / "s.json", max_prompts=3)
    assert stats["prompts"] == 3 and stats["over_max_prompts"] == 2
    assert [p["messages"][0]["content"] for p in read_jsonl(tmp_path / "0.jsonl.zst")] == ["q0", "q1", "q2"]


def test_sources_in_every_container_format(tmp_path):
    rows = [
        {"messages": [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"}]},
        {"messages": [{"role": "user", "content": "second"}]},
    ]
    (tmp_path / "a.json").write_text(json.dumps(rows))
    with open(tmp_path / "a.jsonl.zst", "wb") as f:
        f.write(zstandard.ZstdCompressor().compress("".join(json.dumps(r) + "\n" for r in rows).encode()))
    pq.write_table(pa.Table.from_pylist([{"messages": r["messages"]} for r in rows]), tmp_path / "a.parquet")
    for name in ("a.json", "a.jsonl.zst", "a.parquet"):
        prompts = list(normalize(tmp_path / name, "openai", None, Counter()))
        assert [p["messages"][-1]["content"] for p in prompts] == ["What is 2+2?", "second"], name
        assert [p["source"]["line"] for p in prompts] == [1, 2]


def test_malformed_line_names_file_line_and_fix(tmp_path):
    src = tmp_path / "bad.jsonl"
    src.write_text(json.dumps(SHAREGPT) + "\n" + '{"conversations": [\n')
    with pytest.raises(InputError, match=r"bad\.jsonl:2: malformed JSON .* Fix: make each line one complete JSON"):
        build_prompts(src, "sharegpt", [tmp_path / "0.jsonl.zst"], tmp_path / "s.json")
    assert not (tmp_path / "0.jsonl.zst").exists()


def test_unknown_format_lists_the_known_ones(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [SHAREGPT])
    with pytest.raises(InputError, match="unknown format 'vicuna'.*" + ", ".join(FORMATS)):
        list(normalize(src, "vicuna", None, Counter()))


def test_record_of_the_wrong_format_is_named(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [SHAREGPT, ALPACA])
    with pytest.raises(InputError, match=r"in\.jsonl:2: not a sharegpt record .* needs conversations"):
        list(normalize(src, "sharegpt", None, Counter()))
