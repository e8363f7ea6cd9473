"""A baseline twin (`evaluate.baseline: original`) run end to end on the finished demo: demo_alpaca's prompts
answered by the dataset's own turns, through tokens and hidden states to the SpecForge export, and
demo_alpaca's draft measured beside the same draft trained on it; then the demo as it ships, every data
curve beside its baseline's in the report."""

import json
import shutil
from collections import Counter

import pytest
import yaml

from eagle3_datagen.formats.files import read_jsonl
from tests.helpers import REPO, scheduled, snakemake
from tests.helpers.curves import curves_beside_baselines

pytestmark = pytest.mark.e2e
DEMO = yaml.safe_load((REPO / "config.yaml").read_text())


def test_a_twin_runs_from_the_demos_prompts_to_its_specforge_export(demo_dir, tmp_path):
    """The finished demo (copied, so its other tests see it as it was; the shared run leaves the baseline
    out) with the demo's shipped config, baseline on: demo_alpaca's twin runs its four jobs on the dataset's
    own answers; then only the drafts rerun, beside their baselines: demo_alpaca's is measured against its
    twin's on the same held-out prompts, and every data curve (evaluate.fractions) has the baseline's beside
    it in the report."""
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

    # the rest of the demo as it ships: the other twins, every draft beside its baseline's, the report
    run = snakemake(args, work)
    figures = json.loads((work / "results/demo_alpaca/evaluate/acceptance.json").read_text())
    assert figures["prompts"] == theirs_export["held_out"] and 1.0 <= figures["acceptance_length"] <= 4.0
    baseline = figures["baseline"]
    assert baseline["exports"] == [export] and baseline["prompts"] == figures["prompts"]
    assert 1.0 <= baseline["acceptance_length"] <= 4.0
    assert baseline["draft_acceptance_length"] == figures["acceptance_length"]
    assert baseline["difference"] == pytest.approx(figures["acceptance_length"] - baseline["acceptance_length"])
    low, high = baseline["difference_interval_95"]
    assert -3.0 <= low <= baseline["difference"] <= high <= 3.0  # the paired bootstrap's interval
    assert [p["id"] for p in baseline["per_prompt"]] == [p["id"] for p in figures["per_prompt"]]
    # each data curve and the baseline's beside it, per partition and for the mix: its drafts' figures in
    # curves.json, the report's verdicts, table and plot, and the console's line
    names = [*DEMO["partitions"], "all"]
    curves = curves_beside_baselines(work, names, DEMO["evaluate"]["fractions"], run.stdout + run.stderr)
    print("\n" + "\n".join(c["line"] for c in curves.values()))
