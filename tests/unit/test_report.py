"""The summary page: rendered from its template by scripts/summary.py, as the summary rule runs it."""

import shutil
import subprocess
import sys

from eagle3_datagen.formats.files import read_jsonl, write_json
from eagle3_datagen.reporting.report import partition_summary
from eagle3_datagen.stages.prompts import build_prompts
from tests.helpers import REPO

REALDATA = REPO / "tests" / "fixtures" / "realdata"
MEASURED_BY = "greedy chain <speculative> decoding"
# What stages/evaluate/measure.py returns (less per_prompt and settings, which the page does not show),
# written here: the evaluate rule, which trains a draft in SpecForge's venv, takes minutes. One partition's
# run had the baseline (the draft trained on the dataset's original responses), the other's did not.
EVALUATIONS = {
    "code<1>": {
        "partition": "code<1>",
        "acceptance_length": 1.8421,
        "interval_95": [1.61, 2.05],
        "acceptance_by_position": [0.6, 0.2, 0.05],
        "trainer_estimate": {"acceptance_length": 2.125, "estimated_by": "SpecForge 0.2.0"},
        "prompts": 4,
        "verify_steps": 57,
        "measured_by": MEASURED_BY,
        "baseline": {"acceptance_length": 1.5, "difference": 0.3421, "difference_interval_95": [0.12, 0.57]},
    },
    "hermes": {
        "partition": "hermes",
        "acceptance_length": 1.25,
        "interval_95": [1.0, 1.5],
        "acceptance_by_position": [0.25, 0.0, 0.0],
        "trainer_estimate": {"acceptance_length": 1.3},
        "prompts": 2,
        "verify_steps": 8,
        "measured_by": MEASURED_BY,
    },
}


def test_summary_page_shows_the_numbers_escapes_user_strings_and_shows_the_evaluations(tmp_path):
    # a source path and a partition name with characters HTML must escape
    source_dir = tmp_path / "in<put>&"
    source_dir.mkdir()
    shutil.copy(REALDATA / "python_code_23k_sharegpt.jsonl", source_dir / "code.jsonl")
    sources = {
        "code<1>": (source_dir / "code.jsonl", "sharegpt"),
        "hermes": (REALDATA / "openhermes_2_5.jsonl", "auto"),
    }
    command = [sys.executable, "scripts/summary.py", "--summaries"]
    stats = {}
    for name, (source, fmt) in sources.items():
        stats[name] = build_prompts(source, fmt, [tmp_path / f"{name}.jsonl.zst"], tmp_path / f"{name}.stats.json")
        write_json(tmp_path / f"{name}.json", partition_summary(name, str(tmp_path / f"{name}.stats.json"), [], [], []))
        write_json(tmp_path / f"{name}.acceptance.json", EVALUATIONS[name])
        command.append(str(tmp_path / f"{name}.json"))
    command += ["--evaluations", *(str(tmp_path / f"{name}.acceptance.json") for name in sources)]
    shards = [str(tmp_path / f"{name}.jsonl.zst") for name in sources]
    command += ["--prompt-shards", *shards, "--shard-counts", '[["code<1>", 1], ["hermes", 1]]']
    subprocess.run([*command, "--out", str(tmp_path / "summary.html")], cwd=REPO, check=True, capture_output=True)
    page = (tmp_path / "summary.html").read_text()

    assert "code<1>" not in page and "in<put>" not in page and MEASURED_BY not in page
    assert "<tr><th>metric</th><th>code&lt;1&gt;</th><th>hermes</th></tr>" in page
    assert f"<td>prompts.source</td><td>{source_dir}/code.jsonl</td>".replace("<put>&", "&lt;put&gt;&amp;") in page
    for key in ("records", "prompts"):
        assert f"<tr><td>prompts.{key}</td><td>{stats['code<1>'][key]}</td><td>{stats['hermes'][key]}</td></tr>" in page
    shared = len({p["id"] for p in read_jsonl(shards[0])} & {p["id"] for p in read_jsonl(shards[1])})
    assert f"<tr><td>code&lt;1&gt; &amp; hermes</td><td>{shared}</td></tr>" in page

    # the verdicts lead, the evaluation's plot and table next, every number last and folded away
    assert page.index("<section class='verdict'><h2>code&lt;1&gt;</h2>") < page.index("<h2>Evaluation")
    assert "<dd>1.842 [1.610, 2.050]; +0.342 [0.120, 0.570] over the original responses</dd>" in page
    assert page.index("<details><summary><b>All numbers</b></summary>") > page.index("<h2>Length distributions")
    evaluation = page[page.index("<h2>Evaluation") :]
    evaluation = evaluation[: evaluation.index("<h2>", 4)]
    assert (
        "<tr><td>code&lt;1&gt;</td><td>1.842</td><td>[1.610, 2.050]</td><td>2.125</td><td>4</td><td>57</td>"
        "<td>1.500</td><td>0.342</td><td>[0.120, 0.570]</td></tr>"
        "<tr><td>hermes</td><td>1.250</td><td>[1.000, 1.500]</td><td>1.300</td><td>2</td><td>8</td>"
        "<td>-</td><td>-</td><td>-</td></tr></table>"
    ) in evaluation
    assert "Measured by greedy chain &lt;speculative&gt; decoding." in evaluation
    # three figures of the partitions, one of the evaluations (nothing probed: no probe figure, no
    # curve: one draft size); nothing priced: no empty API cost panel
    assert page.count("<img class='plot'") == 4
    assert "<h2>Throughput and hidden-state bytes (no priced backend in this run)</h2>" in page
    assert "API cost" not in page and "How much data is enough" not in page
    assert evaluation.count("src='data:image/png;base64,") == 1


def test_the_gates_table_shows_each_reasons_count_and_rate_and_the_gates_turned_off():
    from eagle3_datagen.chat.gates import pooled
    from eagle3_datagen.reporting.report import gates_section

    shard = {
        "rows": 40, "dropped_rows": 3, "off": ["repetition"],
        "counts": {"truncated": 2, "empty": 0, "content_filter": 0, "refusal": 1, "reasoning_leak": 0,
                   "reasoning_missing": 0, "reasoning_in_content": 1, "tool_call_syntax": 0,
                   "tool_call_as_text": 0, "failed": 1, "malformed": 0},
    }  # fmt: skip
    other = {**shard, "counts": {**shard["counts"], "refusal": 0}}
    summaries = [{"partition": "chat", "gates": pooled([shard, other])}]
    section = gates_section(summaries)
    assert section["header"][:5] == ["partition", "response rows", "dropped", "truncated", "empty"]
    assert section["rows"] == [
        ["chat", 80, "6 (7.5%)", "4 (5.0%)", "0 (0.0%)", "0 (0.0%)", "1 (1.2%)", "off", "0 (0.0%)", "0 (0.0%)",
         "2 (2.5%)", "0 (0.0%)", "0 (0.0%)", "2 (2.5%)", "0 (0.0%)"],
    ]  # fmt: skip
    assert gates_section([{"partition": "empty", "gates": pooled([])}]) is None
