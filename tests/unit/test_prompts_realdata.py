"""The prompts stage on verbatim records of 15 public datasets (tests/fixtures/realdata: README,
PROVENANCE.md with each record's origin, manifest.tsv with the `format` a user sets).

The expectations are written from reading the records (the text quoted below is the records'),
not from the parser's output.
"""

import json
from collections import Counter
from pathlib import Path

import pytest

from eagle3_datagen.formats.datasets import normalize
from eagle3_datagen.formats.files import InputError, read_jsonl
from eagle3_datagen.stages.prompts import build_prompts

REPO = Path(__file__).resolve().parents[2]
REALDATA = REPO / "tests" / "fixtures" / "realdata"
MANIFEST = [line.split("\t")[:2] for line in (REALDATA / "manifest.tsv").read_text().splitlines()[1:]]


def read(name: str, tmp_path) -> tuple[list[dict], dict]:
    """Every prompt of the file (one shard, so in id order: sorted back into source order), and its stats."""
    fmt = dict(MANIFEST)[name]
    stats = build_prompts(REALDATA / name, fmt, [tmp_path / "0.jsonl.zst"], tmp_path / "stats.json")
    prompts = sorted(read_jsonl(tmp_path / "0.jsonl.zst"), key=lambda p: p["source"]["line"])
    assert json.loads((tmp_path / "stats.json").read_text()) == stats
    return prompts, stats


def users(prompt: dict) -> list[str]:
    return [m["content"] for m in prompt["messages"] if m["role"] == "user"]


def calls(prompt: dict) -> list[tuple[str, dict]]:
    return [
        (c["function"]["name"], json.loads(c["function"]["arguments"]))
        for m in prompt["messages"]
        for c in m.get("tool_calls") or ()
    ]


def results(prompt: dict) -> list[tuple[str, str]]:
    """(the call id a result answers, the function's name) per recorded result."""
    return [(m["tool_call_id"], m["name"]) for m in prompt["messages"] if m["role"] == "tool"]


def tool_names(prompt: dict) -> list[str]:
    return [t["function"]["name"] for t in prompt.get("tools") or ()]


def counted(stats: dict) -> dict:
    """What the stats say was dropped, cut, moved or ignored."""
    keys = ("skipped_", "cut_", "dropped_", "bad_records", "duplicates", "system_tool_list")
    return {
        **{k: v for k, v in stats.items() if k.startswith(keys)},
        **{f"ignored:{k}": v for k, v in stats["ignored_fields"].items()},
        **{f"ignored_turn:{k}": v for k, v in stats["ignored_turn_fields"].items()},
    }


def test_every_file_parses_with_its_manifest_format_and_loses_no_record(tmp_path):
    """Each record is a prompt or is counted with a reason; none crashes its partition."""
    for name, fmt in MANIFEST:
        out = tmp_path / name
        stats = build_prompts(REALDATA / name, fmt, [out / "0.jsonl.zst"], out / "stats.json")
        records = sum(1 for line in (REALDATA / name).read_text().splitlines() if line.strip())
        dropped = sum(v for k, v in stats.items() if k.startswith(("skipped_", "bad_records", "duplicates")))
        assert stats["records"] == records and stats["prompts"] + dropped == records, name
        assert not any(k.startswith(("skipped_", "cut_", "bad_")) for k in stats), (name, stats)


def test_glaive_function_calling_v2(tmp_path):
    first, second, third = read("glaive_function_calling_v2.jsonl", tmp_path)[0]
    assert first["messages"][0] == {
        "role": "system",
        "content": "You are a helpful assistant with access to the following functions. Use them if required",
    }
    assert tool_names(first) == ["detect_language"]
    assert users(first) == [
        "I have a text here and I am not sure what language it is. Can you help me identify it?",
        'Here it is - "Je suis un étudiant"',
    ]
    assert calls(first) == [("detect_language", {"text": "Je suis un étudiant"})]
    assert results(first) == [("functions.detect_language:0", "detect_language")]
    assert first["messages"][-1]["content"] == '{"language": "French"}'
    assert "tools" not in second
    assert second["messages"][0]["content"] == "You are a helpful assistant, with no access to external functions."
    assert users(second) == ["Assign this occupation to the appropriate category\nNurse", "What about an electrician?"]
    assert tool_names(third) == ["search_books", "calculate_tip"]
    assert calls(third) == [("search_books", {"query": "", "author": "George Orwell"})]
    assert results(third) == [("functions.search_books:0", "search_books")]
    assert users(third)[-1] == "Oh yes, I was looking for Animal Farm. Thank you!"


def test_glaive_toolcall_llamafactory_keeps_every_tool_call_and_result(tmp_path):
    """302 records, 35 of them byte-identical repeats (PROVENANCE.md): per record, each `function_call`
    turn is one recorded call, each `observation` one result, each entry of `tools` one tool."""
    records = [json.loads(line) for line in (REALDATA / "glaive_toolcall_llamafactory.jsonl").read_text().splitlines()]
    prompts = list(normalize(REALDATA / "glaive_toolcall_llamafactory.jsonl", "sharegpt", None, Counter()))
    assert len(prompts) == len(records) == 302
    for record, prompt in zip(records, prompts, strict=True):
        froms = Counter(turn["from"] for turn in record["conversations"])
        assert len(calls(prompt)) == froms["function_call"] and len(results(prompt)) == froms["observation"]
        assert len(users(prompt)) == froms["human"]
        assert len(tool_names(prompt)) == len(json.loads(record["tools"] or "[]"))
    _, stats = read("glaive_toolcall_llamafactory.jsonl", tmp_path)
    distinct = {line for line in (REALDATA / "glaive_toolcall_llamafactory.jsonl").read_text().splitlines()}
    assert stats["duplicates"] >= 302 - len(distinct) == 35


def test_sharegpt_vicuna_and_python_code(tmp_path):
    first, second = read("sharegpt_vicuna.jsonl", tmp_path / "v")[0]
    assert len(users(first)) == 3 and len(users(second)) == 6
    assert users(first)[0].startswith('Why does `dir` command in DOS see the "<.<" argument as "\\*.\\*"?')
    assert users(second)[1].startswith("could you give me the gist of how it could though?")
    [python] = read("python_code_23k_sharegpt.jsonl", tmp_path / "p")[0]
    assert users(python) == [
        "Create a nested loop to print every combination of numbers between 0-9, excluding any combination that "
        "contains the number 5. Additionally, exclude any combination that contains a repeating digit. Implement "
        "the solution without using any built-in functions or libraries to check for repeating digits."
    ]
    assert python["source"]["id"] == "0"


def test_openhermes_empty_system_turn_is_dropped_as_a_turn(tmp_path):
    [prompt], stats = read("openhermes_2_5.jsonl", tmp_path)
    assert [m["role"] for m in prompt["messages"]] == ["user"]
    assert users(prompt)[0].startswith("Every day, a tree drops 7 leaves.")
    assert counted(stats) == {"dropped_empty_system_turn": 1, "ignored:source": 1, "ignored:category": 1}


HERMES_PROSE = (
    "You are a function calling AI model. You are provided with function signatures within <tools> </tools> "
    "XML tags. You may call one or more functions to assist with the user query. Don't make assumptions about "
    "what values to plug into functions.\nFor each function call return a json object with function name and "
    "arguments within <tool_call> </tool_call> tags with the following schema:\n<tool_call>\n"
    "{'arguments': <args-dict>, 'name': <function-name>}\n</tool_call>\n"
)


def test_hermes_tools_calls_and_responses(tmp_path):
    """The `<tools>` block (a Python-literal list) moves to `tools`; the `<tool_call>` dict (single-quoted,
    `True`) becomes a call; the `<tool_response>` its result. The JSON-mode records keep their schema prompt."""
    (tools_record, movie, agent), stats = read("hermes_function_calling_v1.jsonl", tmp_path)
    assert tools_record["messages"][0] == {"role": "system", "content": HERMES_PROSE}
    assert tool_names(tools_record) == ["search_flights"]
    assert tools_record["tools"][0]["function"]["parameters"]["properties"]["class"]["enum"] == [
        "economy",
        "business",
        "first",
    ]
    assert calls(tools_record) == [
        (
            "search_flights",
            {
                "departure_city": "Los Angeles",
                "destination_city": "Auckland",
                "departure_date": "2023-07-10",
                "return_date": "2023-07-24",
                "class": "economy",
                "flexible_cancellation": True,
            },
        )
    ]
    assert results(tools_record) == [("functions.search_flights:0", "search_flights")]
    assert tools_record["messages"][-1]["content"].startswith('{"name": "search_flights", "content": {"flights": [')
    assert tools_record["messages"][-1]["content"].endswith('"flexible_cancellation": true}]}}')
    for prompt in (movie, agent):
        assert "tools" not in prompt and [m["role"] for m in prompt["messages"]] == ["system", "user"]
        # kept as written, the trailing newline included
        assert prompt["messages"][0]["content"].startswith("You are a helpful assistant that answers in JSON.")
        assert prompt["messages"][0]["content"].endswith("\n</schema>\n")
    assert movie["source"]["id"] == "57aa5f1b-6af3-42b8-9598-d48540277354"
    assert counted(stats) == {
        "system_tool_list_moved_to_tools": 1,
        "ignored:category": 3,
        "ignored:subcategory": 3,
        "ignored:task": 1,
        "ignored:schema": 2,  # the JSON-mode schema, also in the system prompt
        "ignored:__index_level_0__": 1,
    }


def test_toolace_top_level_system_function_list_and_bracket_calls(tmp_path):
    [prompt], stats = read("toolace.jsonl", tmp_path)
    system = prompt["messages"][0]
    assert system["role"] == "system"
    assert system["content"].startswith("You are an expert in composing functions.")
    assert "GetCompetitions" not in system["content"]
    assert system["content"].endswith("NO other text MUST be included. \n")
    assert tool_names(prompt) == [
        "GetCompetitions",
        "Get Manager Placeholder Image",
        "Search Competition API",
        "Get Category Image",
    ]
    assert users(prompt) == [
        "Hey, can you show me the list of football competitions that are currently televised in Peru?",
        "How important are manager images in sports marketing and branding?",
        "I'd like to see this in practice! Can you fetch me a manager placeholder image for football? Let's bring "
        "these theories to life with some quality pixels.",
    ]
    assert calls(prompt) == [("GetCompetitions", {}), ("Get Manager Placeholder Image", {"sport": "football"})]
    assert results(prompt) == [
        ("functions.GetCompetitions:0", "GetCompetitions"),
        ("functions.Get Manager Placeholder Image:1", "Get Manager Placeholder Image"),
    ]
    assert counted(stats) == {"system_tool_list_moved_to_tools": 1}


def test_code_feedback_and_alpaca(tmp_path):
    [feedback] = read("code_feedback.jsonl", tmp_path / "f")[0]
    assert users(feedback) == [
        "Write a Ruby code to convert a double-linked list to a single-linked list without using any built-in "
        "methods or data structures.",
        "Write a code snippet using Python to pop an element from a list, but without using the built-in `pop()` "
        "function, slicing, or any additional data structures.",
    ]
    assert feedback["source"]["id"] == "1"
    alpaca, stats = read("alpaca_llamafactory.jsonl", tmp_path / "a")
    assert len(alpaca) == 40 and sum("\n\n" in users(p)[0] for p in alpaca) >= 15
    assert users(alpaca[0]) == ["Describe a process of making crepes."]
    assert users(alpaca[5]) == [
        "Given the parameters of a triangle, find out its perimeter.\n\nSide 1 = 4\nSide 2 = 6\nSide 3 = 8"
    ]
    assert counted(stats) == {}


def test_code_datasets_with_auto(tmp_path):
    [evol] = read("magicoder_evol_instruct_110k.jsonl", tmp_path / "e")[0]
    assert users(evol)[0].startswith("Please amend the subsequent Python script so that it includes a 'while' loop")
    assert evol["source"]["format"] == "alpaca"
    [oss], oss_stats = read("magicoder_oss_instruct_75k.jsonl", tmp_path / "o")
    assert oss["source"]["format"] == "problem_solution"
    assert users(oss)[0].startswith("You are given two arrays, A and B, each of length n.")
    assert users(oss)[0].endswith("convolution(a, b) -> [4, 13, 28, 27, 18]")
    assert counted(oss_stats) == {
        f"ignored:{k}": 1 for k in ("lang", "raw_index", "index", "seed", "openai_fingerprint")
    }
    [code80k] = read("evol_instruct_code_80k.jsonl", tmp_path / "c")[0]
    assert users(code80k)[0].startswith("Create a nested loop to print every combination of numbers between 0-9")
    [filtered], filtered_stats = read("codefeedback_filtered_instruction.jsonl", tmp_path / "q")
    assert filtered["source"]["format"] == "query_answer"
    assert users(filtered) == [
        "You need to convert the following statement in SQL to equivalent PostgreSQL syntax and return only the rows "
        "where the Name starts with 'J', has a length greater than 4, and the Age is greater than or equal to 18."
    ]
    assert counted(filtered_stats) == {"ignored:resource": 1, "ignored:lang": 1}


def test_xlam_and_apigen_answers_become_the_first_assistant_turns_calls(tmp_path):
    (strings, parsed), stats = read("xlam_function_calling_60k.jsonl", tmp_path / "x")
    assert users(strings) == ["Where can I find live giveaways for beta access and games?"]
    assert tool_names(strings) == ["live_giveaways_by_type"]
    assert strings["tools"][0]["function"]["parameters"] == {
        "type": "object",
        "properties": {
            "type": {
                "description": "The type of giveaways to retrieve (e.g., game, loot, beta).",
                "type": "str",
                "default": "game",
            }
        },
    }
    assert calls(strings) == [
        ("live_giveaways_by_type", {"type": "beta"}),
        ("live_giveaways_by_type", {"type": "game"}),
    ]
    assert [m["role"] for m in strings["messages"]] == ["user", "assistant"]
    assert tool_names(parsed) == ["find_peak_element", "light_travel_time"]
    assert parsed["tools"][0]["function"]["parameters"]["required"] == ["nums"]
    assert calls(parsed) == [
        ("find_peak_element", {"nums": [44, 46, 48, 50, 52]}),
        ("light_travel_time", {"distance_in_light_years": 25}),
    ]
    assert parsed["source"]["id"] == "8" and counted(stats) == {}
    [apigen], apigen_stats = read("apigen_function_calling.jsonl", tmp_path / "a")
    assert tool_names(apigen) == ["split_list", "binary_search"]
    assert calls(apigen) == [
        ("split_list", {"lst": [10, 20, 30, 40, 50, 60], "chunk_size": 4}),
        ("binary_search", {"arr": [10, 20, 30, 40, 50, 60], "target": 30}),
    ]
    assert counted(apigen_stats) == {
        f"ignored:{k}": 1 for k in ("func_name", "func_desc", "hash_id", "model_name", "origin")
    }


def test_unreadable_records_are_counted_and_fail_the_partition_only_above_the_rate(tmp_path):
    source = tmp_path / "mixed.jsonl"
    lines = (REALDATA / "toolace.jsonl").read_text().splitlines() + ['{"prompt": "no known layout"}']
    source.write_text("\n".join(lines) + "\n")
    shard = tmp_path / "0.jsonl.zst"
    with pytest.raises(InputError, match=r"mixed\.jsonl:2: 1 of 2 records .* line 2: no known layout has the keys"):
        build_prompts(source, "auto", [shard], tmp_path / "stats.json")
    assert not shard.exists() and not (tmp_path / "stats.json").exists()
    stats = build_prompts(source, "auto", [shard], tmp_path / "stats.json", max_bad_record_rate=0.5)
    assert stats["prompts"] == 1 and stats["bad_records"] == 1
    assert stats["bad_record_examples"] == [{"line": 2, "reason": "no known layout has the keys ['prompt']"}]


def test_prompts_shared_with_earlier_partitions_are_dropped_when_asked(tmp_path):
    earlier = [tmp_path / "a.jsonl.zst"]
    build_prompts(REALDATA / "python_code_23k_sharegpt.jsonl", "sharegpt", earlier, tmp_path / "a.json")
    later = tmp_path / "b.jsonl.zst"
    source = tmp_path / "both.jsonl"
    source.write_text(
        (REALDATA / "python_code_23k_sharegpt.jsonl").read_text() + (REALDATA / "openhermes_2_5.jsonl").read_text()
    )
    kept = build_prompts(source, "sharegpt", [later], tmp_path / "b.json")
    assert kept["prompts"] == 2
    dropped = build_prompts(source, "sharegpt", [later], tmp_path / "b.json", earlier_shards=earlier)
    assert dropped["prompts"] == 1 and dropped["shared_with_earlier_partitions"] == 1
    assert [p["source"]["line"] for p in read_jsonl(later)] == [2]


def test_report_counts_shared_prompts_and_shows_what_each_partition_dropped_and_ignored(tmp_path):
    from eagle3_datagen.reporting.report import partition_summary, shared_prompts, summary_html

    python_code = REALDATA / "python_code_23k_sharegpt.jsonl"
    both = tmp_path / "both.jsonl"
    both.write_text(python_code.read_text() + (REALDATA / "openhermes_2_5.jsonl").read_text())
    shards = [tmp_path / "a.jsonl.zst", tmp_path / "b0.jsonl.zst", tmp_path / "b1.jsonl.zst"]
    build_prompts(python_code, "sharegpt", shards[:1], tmp_path / "a.json")
    build_prompts(both, "sharegpt", shards[1:], tmp_path / "b.json")
    shared = shared_prompts([str(s) for s in shards], [["a", 1], ["b", 2]])
    assert shared == {"per_partition": {"a": 1, "b": 1}, "pairs": {"a & b": 1}}
    page = summary_html(
        [partition_summary(name, str(tmp_path / f"{name}.json"), [], [], []) for name in ("a", "b")],
        shared,
    )
    assert "Prompts shared between partitions" in page and "<td>a &amp; b</td><td>1</td>" in page
    # rows of keys only the second partition has: its dropped turn and its ignored fields
    for key in (
        "prompts.dropped_empty_system_turn",
        "prompts.ignored_fields.source",
        "prompts.ignored_fields.category",
    ):
        assert f"<td>{key}</td><td></td><td>1</td>" in page
    with pytest.raises(ValueError, match="add up otherwise"):
        shared_prompts([str(s) for s in shards], [["a", 1], ["b", 1]])
