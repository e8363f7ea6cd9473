import hashlib
import json
from collections import Counter

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
import zstandard

from eagle3_datagen.formats.datasets import LAYOUT_CHOICES, conversation_id, normalize
from eagle3_datagen.formats.files import InputError, read_jsonl
from eagle3_datagen.stages.prompts import build_prompts, shard_of
from tests.helpers import copy_workflow, scheduled, snakemake
from tests.helpers.records import GLAIVE_CHAIN, write_jsonl

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
        # the recorded call and its result are kept for generation to compare and reuse
        (
            "glaive",
            GLAIVE,
            [
                ("system", "You can call get_time."),
                ("user", "What time is it?"),
                ("assistant", ""),
                ("tool", '{"time": "10:00"}'),
                ("user", "Thanks"),
            ],
        ),
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
    with pytest.raises(InputError, match="unknown format 'vicuna'.*" + ", ".join(LAYOUT_CHOICES)):
        list(normalize(src, "vicuna", None, Counter()))


def test_record_of_the_wrong_format_is_named(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [SHAREGPT, ALPACA])
    with pytest.raises(
        InputError, match=r"in\.jsonl:2: 1 of 2 .* line 2: not a sharegpt record .* needs conversations"
    ):
        list(normalize(src, "sharegpt", None, Counter()))


def test_text_is_kept_as_written_and_an_empty_system_turn_is_dropped_alone(tmp_path):
    record = {
        "conversations": [
            {"from": "system", "value": "  "},
            {"from": "human", "value": "  indented\n"},
            {"from": "gpt", "value": "ok"},
        ]
    }
    stats = Counter()
    [prompt] = list(normalize(write_jsonl(tmp_path / "in.jsonl", [record]), "sharegpt", None, stats))
    assert prompt["messages"] == [{"role": "user", "content": "  indented\n"}]
    assert stats["dropped_empty_system_turn"] == 1


def test_toolace_calls_with_spaced_names_nested_literals_and_commas_in_strings():
    from eagle3_datagen.formats.datasets.toolcalls import toolace_calls

    parsed = toolace_calls('[Get Image(sport="foot, ball)"), Search(ids=[1, 2], opts={"a": True})]')
    assert [(c["name"], c["arguments"]) for c in parsed] == [
        ("Get Image", '{"sport":"foot, ball)"}'),
        ("Search", '{"ids":[1,2],"opts":{"a":true}}'),
    ]
    assert toolace_calls("[1, 2, 3] is a list") is None and toolace_calls("Plain [text]") is None


def test_prompt_settings_hold_every_key_and_name_earlier_partitions_only_when_dropping():
    from eagle3_datagen.config_schema import fill_defaults
    from eagle3_datagen.workflow.settings import prompt_settings

    partitions = {
        "b": {"source": "b.jsonl", "format": "auto"},
        "a": {"source": "a.jsonl", "format": "glaive", "max_bad_record_rate": 0.01},
    }
    config = fill_defaults({"partitions": partitions})
    assert prompt_settings(config, "b") == {
        "format": "auto",
        "system_prompt": None,
        "max_prompts": None,
        "subset": None,
        "split": None,
        "revision": None,
        "max_bad_record_rate": 0,
        "allow_empty": False,
        "source": None,
        "commit": None,
        "drop_shared_with": [],
    }
    assert prompt_settings(config, "a")["max_bad_record_rate"] == 0.01
    config["prompts"] = {"shared_across_partitions": "drop"}
    assert prompt_settings(config, "b")["drop_shared_with"] == ["a"]
    assert prompt_settings(config, "a")["drop_shared_with"] == []


def test_glaive_functions_calls_and_results_become_openai_tools_with_kimi_ids(tmp_path):
    src = write_jsonl(tmp_path / "glaive.jsonl", [GLAIVE_CHAIN])
    stats = Counter()
    [prompt] = list(normalize(src, "glaive", None, stats))
    assert [t["function"]["name"] for t in prompt["tools"]] == ["calculate_factorial", "get_news_headlines"]
    assert prompt["tools"][0] == {
        "type": "function",
        "function": {
            "name": "calculate_factorial",
            "description": "Calculate the factorial of a given number",
            "parameters": {
                "type": "object",
                "properties": {"number": {"type": "integer", "description": "The number to calculate factorial for"}},
                "required": ["number"],
            },
        },
    }
    assert prompt["messages"] == [
        {
            "role": "system",
            "content": "You are a helpful assistant with access to the following functions. Use them if required",
        },
        {"role": "user", "content": "Hi, I need to calculate the factorial of 5. Can you help me with that?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "functions.calculate_factorial:0",
                    "type": "function",
                    "function": {"name": "calculate_factorial", "arguments": '{"number":5}'},
                }
            ],
        },
        {
            "role": "tool",
            "tool_call_id": "functions.calculate_factorial:0",
            "name": "calculate_factorial",
            "content": '{"result": 120}',
        },
        {"role": "user", "content": "And the news for the United States?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "functions.get_news_headlines:1",
                    "type": "function",
                    "function": {"name": "get_news_headlines", "arguments": '{"country":"United States"}'},
                }
            ],
        },
        {
            "role": "tool",
            "tool_call_id": "functions.get_news_headlines:1",
            "name": "get_news_headlines",
            "content": '{"headlines": ["A", "B"]}',
        },
        {"role": "user", "content": "Thanks!"},
    ]
    assert stats == Counter(records=1, system_tool_list_moved_to_tools=1)
    written = build_prompts(src, "glaive", [tmp_path / "0.jsonl.zst"], tmp_path / "stats.json")
    assert (written["with_tools"], written["recorded_tool_calls"], written["multi_turn"]) == (1, 2, 1)


def test_glaive_unparsable_arguments_cut_the_conversation_there_and_are_counted(tmp_path):
    broken = dict(GLAIVE_CHAIN, chat=GLAIVE_CHAIN["chat"].replace("""'{\"number\": 5}'""", """'{\"number\": 5'"""))
    escaped = dict(GLAIVE_CHAIN, chat=GLAIVE_CHAIN["chat"].replace('"number": 5}', '"number": 5, "note": "it\\\'s"}'))
    no_functions = {
        "system": "SYSTEM: You are a helpful assistant, with no access to external functions.",
        "chat": "USER: Tell me a joke. ASSISTANT: Why did the chicken cross the road? <|endoftext|>",
    }
    src = write_jsonl(tmp_path / "glaive.jsonl", [broken, escaped, no_functions])
    stats = Counter()
    cut, unescaped, plain = list(normalize(src, "glaive", None, stats))
    assert [m["role"] for m in cut["messages"]] == ["system", "user"] and len(cut["tools"]) == 2
    assert stats["cut_tool_call_unparsed"] == 1
    assert unescaped["messages"][2]["tool_calls"][0]["function"]["arguments"] == '{"number":5,"note":"it\'s"}'
    assert "tools" not in plain
    assert plain["messages"] == [
        {"role": "system", "content": "You are a helpful assistant, with no access to external functions."},
        {"role": "user", "content": "Tell me a joke."},
    ]


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def test_openai_and_sharegpt_tool_records_keep_calls_and_results(tmp_path):
    openai = {
        "tools": [WEATHER_TOOL],
        "messages": [
            {"role": "user", "content": "Weather in Paris and Rome?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_a",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                    },
                    {
                        "id": "call_b",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": {"city": "Rome"}},
                    },
                ],
            },
            # answered out of order: the source ids say which call each result belongs to
            {"role": "tool", "tool_call_id": "call_b", "content": "18C"},
            {"role": "tool", "tool_call_id": "call_a", "content": "21C"},
            {"role": "assistant", "content": "Paris 21C, Rome 18C."},
        ],
    }
    sharegpt = {
        "tools": json.dumps([WEATHER_TOOL["function"]]),  # LLaMA-Factory's layout: bare functions as a JSON string
        "conversations": [
            {"from": "human", "value": "Weather in Oslo?"},
            {"from": "function_call", "value": '{"name": "get_weather", "arguments": {"city": "Oslo"}}'},
            {"from": "observation", "value": "-3C"},
            {"from": "gpt", "value": "It is -3C in Oslo."},
        ],
    }
    src = write_jsonl(tmp_path / "tools.jsonl", [openai, sharegpt])
    first, second = list(normalize(src, "auto", None, Counter()))
    assert first["tools"] == [WEATHER_TOOL] and second["tools"] == [WEATHER_TOOL]
    calls = first["messages"][1]["tool_calls"]
    assert [(c["id"], c["function"]["arguments"]) for c in calls] == [
        ("functions.get_weather:0", '{"city":"Paris"}'),
        ("functions.get_weather:1", '{"city":"Rome"}'),
    ]
    assert [(m["tool_call_id"], m["content"]) for m in first["messages"][2:]] == [
        ("functions.get_weather:1", "18C"),
        ("functions.get_weather:0", "21C"),
    ]
    assert second["messages"][1:] == [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "functions.get_weather:0",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "functions.get_weather:0", "name": "get_weather", "content": "-3C"},
    ]


def test_ids_hash_the_messages_and_tools_and_tools_enter_the_id():
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    canonical = json.dumps({"messages": messages, "tools": []}, separators=(",", ":"), sort_keys=True)
    assert conversation_id(messages) == hashlib.sha256(canonical.encode()).hexdigest()[:24]
    with_tools = conversation_id(messages, [WEATHER_TOOL])
    assert with_tools != conversation_id(messages)
    other_tool = {"type": "function", "function": {**WEATHER_TOOL["function"], "description": "Other"}}
    assert with_tools != conversation_id(messages, [other_tool])


def test_legacy_function_calls_and_orphan_results(tmp_path):
    legacy = {
        "functions": [WEATHER_TOOL["function"]],
        "messages": [
            {"role": "user", "content": "Weather in Lima?"},
            {
                "role": "assistant",
                "content": None,
                "function_call": {"name": "get_weather", "arguments": '{"city":"Lima"}'},
            },
            {"role": "function", "name": "get_weather", "content": "25C"},
        ],
    }
    orphan = {
        "conversations": [
            {"from": "human", "value": "Hi"},
            {"from": "observation", "value": "a result nobody asked for"},
            {"from": "human", "value": "Hello?"},
        ]
    }
    src = write_jsonl(tmp_path / "legacy.jsonl", [legacy, orphan])
    stats = Counter()
    first, second = list(normalize(src, "auto", None, stats))
    assert first["tools"] == [WEATHER_TOOL]
    assert first["messages"][2] == {
        "role": "tool",
        "tool_call_id": "functions.get_weather:0",
        "name": "get_weather",
        "content": "25C",
    }
    assert second["messages"] == [{"role": "user", "content": "Hi"}] and stats["cut_tool_result_unmatched"] == 1


def test_question_answer_and_alpaca_history_layouts(tmp_path):
    """glaive-code-assistant's `question`/`answer` (its card: "a QA format"; no verbatim row was found,
    tests/fixtures/realdata/PROVENANCE.md, so this record is written here) and LLaMA-Factory's alpaca
    `history` ([query, response] pairs before the instruction)."""
    qa = {"question": "How do I reverse a list in Python?", "answer": "Use `lst[::-1]`."}
    history = {"instruction": "And a tuple?", "output": "The same.", "history": [["Reverse a list?", "lst[::-1]"]]}
    first, second = list(normalize(write_jsonl(tmp_path / "in.jsonl", [qa, history]), "auto", None, Counter()))
    assert first["messages"] == [{"role": "user", "content": "How do I reverse a list in Python?"}]
    assert first["source"]["format"] == "query_answer"
    assert [m["content"] for m in second["messages"]] == ["Reverse a list?", "And a tuple?"]


def test_shared_prompts_drop_makes_later_partitions_read_the_earlier_ones_prompts(tmp_path):
    """`keep` (the default) leaves the prompts rules independent; `drop` gives a partition the prompt shards
    of those before it in name order."""
    work = copy_workflow(tmp_path / "wf")
    target = ["-n", "-p", "--profile", "profiles/local", "results/demo_sharegpt/prompts/stats.json"]
    keep = snakemake(target, work).stdout
    assert sorted(r for r, _ in scheduled(keep)) == ["prompts_demo_sharegpt"]
    assert (
        "python scripts/prompts.py --source resources/demo/data/sharegpt.jsonl --earlier  --out "
        "results/demo_sharegpt/prompts/00000.jsonl.zst results/demo_sharegpt/prompts/00001.jsonl.zst --stats"
    ) in keep
    config = yaml.safe_load((work / "config.yaml").read_text())
    config["prompts"] = {"shared_across_partitions": "drop"}
    (work / "drop.yaml").write_text(yaml.safe_dump(config))
    drop = snakemake([*target, "--configfile", "drop.yaml"], work).stdout
    assert sorted(r for r, _ in scheduled(drop)) == [
        "prompts_demo_alpaca",
        "prompts_demo_openai",
        "prompts_demo_sharegpt",
    ]
    earlier = "results/demo_alpaca/prompts/00000.jsonl.zst results/demo_openai/prompts/00000.jsonl.zst"
    assert f"--earlier {earlier} results/demo_openai/prompts/00001.jsonl.zst --out" in drop
