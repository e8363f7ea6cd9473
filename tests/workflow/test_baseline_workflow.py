"""A baseline twin (`evaluate.baseline: original`) run end to end on the finished demo: demo_alpaca's prompts
answered by the dataset's own turns, through tokens and hidden states to the SpecForge export, and
demo_alpaca's drafts (the whole's and the data curve's point) measured beside the same drafts trained on it.
Every partition's and the mix's curve beside its baseline's in the report: the same check
(tests/helpers/curves.py) on the tiny Kimi's run, tests/workflow/test_tiny_kimi.py."""

import json
import shutil
from collections import Counter

import pytest
import yaml

from eagle3_datagen.formats.files import read_jsonl
from tests.helpers import REPO, scheduled, snakemake

pytestmark = pytest.mark.e2e
DEMO = yaml.safe_load((REPO / "config.yaml").read_text())


def test_a_twin_runs_from_the_demos_prompts_to_its_specforge_export(demo_dir, tmp_path):
    """The finished demo (copied, so its other tests see it as it was; the shared run leaves the baseline
    out) with the demo's shipped config, baseline on: demo_alpaca's twin runs its four jobs on the dataset's
    own answers; the whole workflow would then rerun only the drafts, beside their baselines, and the other
    twins; demo_alpaca's two drafts (evaluate.fractions: half and all of its samples) run, each measured
    against its twin's on the same held-out prompts (the other drafts, each a job training two drafts, are
    left out: the report's curves beside their baselines are checked on the tiny Kimi's run)."""
    work = tmp_path / "wf"
    shutil.copytree(demo_dir, work, symlinks=True)
    assert DEMO["evaluate"]["baseline"] == "original"
    (work / "baseline.yaml").write_text(yaml.safe_dump(DEMO))
    export = "results/demo_alpaca+original/export/specforge"
    args = ["--profile", "profiles/local", "--configfile", "baseline.yaml"]
    listed = snakemake([export, "-n", *args], work).stdout
    assert Counter(r for r, _ in scheduled(listed)) == {"responses": 1, "tokens": 1, "hidden_states": 1, "export": 1}
    snakemake([export, *args], work)

    records = json.loads((REPO / "resources/demo/data/alpaca.json").read_text())
    rows = read_jsonl(work / "results/demo_alpaca+original/responses/00000.jsonl.zst")
    prompts = read_jsonl(work / "results/demo_alpaca/prompts/00000.jsonl.zst")
    assert [r["id"] for r in rows] == [p["id"] for p in prompts]
    for row in rows:
        answers = [m["content"] for m in row["messages"] if m["role"] == "assistant"]
        assert answers == [records[row["source"]["line"] - 1]["output"]]
    index = json.loads((work / "results/demo_alpaca+original/hidden/00000/index.json").read_text())
    assert index["samples"] == len(rows)
    ours = read_jsonl(work / "results/demo_alpaca+original/tokens/00000.jsonl.zst")
    regenerated = read_jsonl(work / "results/demo_alpaca/tokens/00000.jsonl.zst")
    # every prompt answered (the regenerated data drops its truncated and malformed rows), other answers
    assert [s["id"] for s in ours] == [p["id"] for p in prompts]
    assert {s["id"] for s in regenerated} <= {s["id"] for s in ours}
    by_id = {s["id"]: s["input_ids"] for s in ours}
    assert any(by_id[s["id"]] != s["input_ids"] for s in regenerated)
    ours_export = json.loads((work / export / "export.json").read_text())
    # the export leaves out demo_alpaca's held-out prompts (evaluate.holdout), as demo_alpaca's does
    assert ours_export["held_out"] == DEMO["evaluate"]["holdout"]
    assert (ours_export["samples"] + ours_export["held_out"], ours_export["shards"]) == (
        len(rows),
        ["results/demo_alpaca+original/hidden/00000"],
    )
    # the same capture, trainer and draft (its config, the draft vocabulary) as the regenerated data's export
    theirs = work / "results/demo_alpaca/export/specforge"
    same = ("aux_layers", "final", "final_norm_applied", "format", "specforge_aux_layer_ids", "trainer")
    theirs_export = json.loads((theirs / "export.json").read_text())
    assert {k: ours_export[k] for k in same} == {k: theirs_export[k] for k in same}
    assert (work / export / "draft_config.json").read_text() == (theirs / "draft_config.json").read_text()
    ours_yaml, theirs_yaml = (yaml.safe_load((d / "specforge.yaml").read_text()) for d in (work / export, theirs))
    assert ours_yaml["model"].pop("draft_model_config").endswith(f"{export}/draft_config.json")
    del theirs_yaml["model"]["draft_model_config"]
    # the same target, heads and draft vocabulary (their paths written in the demo's folder, before the copy)
    assert ours_yaml["model"] == {k: v.replace(str(demo_dir), str(work)) for k, v in theirs_yaml["model"].items()}
    # the whole workflow then: the other twins, and every draft trained again beside its baseline; no job of
    # the demo's data, none of this twin's
    jobs = scheduled(snakemake(["-n", *args], work).stdout)
    # the curve's points below the whole too (evaluate.fractions)
    points = {("evaluate_point", p) for p in DEMO["partitions"] if set(DEMO["evaluate"]["fractions"]) - {1}}
    assert {(r, p) for r, p in jobs if p and "+" not in p} == {("evaluate", p) for p in DEMO["partitions"]} | points
    assert "demo_alpaca+original" not in {p for _, p in jobs}

    # demo_alpaca's drafts beside its twin's: the whole's and the curve's point below it
    curve = [f"results/demo_alpaca/evaluate/curve/{f}.json" for f in sorted(DEMO["evaluate"]["fractions"]) if f < 1]
    snakemake(["results/demo_alpaca/evaluate/acceptance.json", *curve, *args], work)
    figures = json.loads((work / "results/demo_alpaca/evaluate/acceptance.json").read_text())
    assert figures["prompts"] == theirs_export["held_out"] and 1.0 <= figures["acceptance_length"] <= 4.0
    drafts = [*(json.loads((work / c).read_text()) for c in curve), figures]
    for draft in drafts:
        baseline = draft["baseline"]
        assert baseline["exports"] == [export] and baseline["prompts"] == draft["prompts"] == figures["prompts"]
        assert 1.0 <= baseline["acceptance_length"] <= 4.0
        assert baseline["draft_acceptance_length"] == draft["acceptance_length"]
        assert baseline["difference"] == pytest.approx(draft["acceptance_length"] - baseline["acceptance_length"])
        low, high = baseline["difference_interval_95"]
        assert -3.0 <= low <= baseline["difference"] <= high <= 3.0  # the paired bootstrap's interval
        assert [p["id"] for p in baseline["per_prompt"]] == [p["id"] for p in draft["per_prompt"]]
        # the twin drops none of the prompts the regenerated data keeps
        assert draft["samples"] <= baseline["samples"]
    # a fraction trains on fewer samples, in the regenerated data and in the baseline's
    assert [d["samples"] for d in drafts] == sorted({d["samples"] for d in drafts})
    assert [d["baseline"]["samples"] for d in drafts] == sorted({d["baseline"]["samples"] for d in drafts})
    for d in drafts:
        print(f"\n{d['samples']} samples: {d['acceptance_length']:.3f}; baseline's", end=" ")
        print(f"{d['baseline']['samples']}: {d['baseline']['acceptance_length']:.3f}", end="")
