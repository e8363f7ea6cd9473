"""The data curve (reporting/curve.py): acceptance length against log2(samples), the paired bootstrap over
held-out prompts, the extrapolation and its price; the nested training subsets the curve's drafts train on
(stages/evaluate/measure.py)."""

import json

import pytest

from eagle3_datagen.reporting.curve import (
    baseline_words,
    curve_line,
    data_price,
    fit_curve,
    per_sample_price,
    points_of,
    slope_difference,
    verdict_words,
)
from eagle3_datagen.stages.evaluate.measure import nested_subset, training_data

PROMPT_OFFSETS = {"a": -1, "b": 1, "c": -2, "d": 2}  # each prompt easier or harder by as much at every size


def curve(levels: list[int], sizes=(4, 8, 16)) -> list[tuple[int, dict]]:
    """Drafts at `sizes` samples whose prompts each commit `level + offset` tokens in 10 verify steps."""
    return [
        (n, {p: (level + o, 10) for p, o in PROMPT_OFFSETS.items()}) for n, level in zip(sizes, levels, strict=True)
    ]


def test_the_fit_is_the_least_squares_line_on_log2_samples_and_the_paired_bootstrap_cancels_prompt_difficulty():
    fit = fit_curve(curve([15, 20, 25]), reps=500, ceiling=4.0)
    assert [p["acceptance_length"] for p in fit["points"]] == [1.5, 2.0, 2.5]
    # each point alone varies with which prompts a resample draws (1.3 to 1.7 at 4 samples) ...
    low, high = fit["points"][0]["interval_95"]
    assert low < 1.45 and high > 1.55
    # ... but every prompt gains 0.5 per doubling: paired over prompts, the slope's interval is that alone
    assert fit["gain_per_doubling"] == pytest.approx(0.5)
    assert fit["gain_per_doubling_interval_95"] == pytest.approx([0.5, 0.5])
    assert fit["last_doubling"] == {
        "from_samples": 8,
        "to_samples": 16,
        "gain": pytest.approx(0.5),
        "interval_95": pytest.approx([0.5, 0.5]),
    }
    assert [(e["factor"], e["samples"], e["acceptance_length"]) for e in fit["extrapolated"]] == [
        (2, 32, pytest.approx(3.0)),
        (4, 64, pytest.approx(3.5)),
    ]
    # never past every proposal accepted (num_steps + 1)
    capped = fit_curve(curve([15, 20, 25]), reps=50, ceiling=3.0)
    assert [e["acceptance_length"] for e in capped["extrapolated"]] == [3.0, 3.0]
    assert fit_curve(curve([15], sizes=(4,))) is None  # one size: no line


def test_a_flatter_curve_is_told_apart_with_the_differences_interval():
    """Extra samples that add nothing new (copies) against new ones: the slopes' difference and its interval."""
    new, copies = curve([15, 20, 25]), curve([15, 16, 17])
    assert fit_curve(copies, reps=50)["gain_per_doubling"] == pytest.approx(0.1)
    difference = slope_difference(new, copies, reps=500)
    assert difference["difference"] == pytest.approx(0.4) and difference["paired"]
    assert difference["interval_95"] == pytest.approx([0.4, 0.4])


def test_the_price_of_more_data_is_the_plans_per_prompt_or_what_the_run_measured():
    plan_rows = [
        {"prompts": 60, "cost_usd": 6.0, "generation_node_hours": 0.6, "hidden_node_hours": 0.3, "hidden_bytes": 6e8},
        {"prompts": 40, "cost_usd": 4.0, "generation_node_hours": None, "hidden_node_hours": 0.1, "hidden_bytes": 4e8},
    ]
    summaries = [{"partition": "x"}, {"partition": "y"}]
    per_sample = per_sample_price(plan_rows, summaries)
    assert per_sample == {
        "usd": pytest.approx(0.1),
        "node_hours": pytest.approx(0.01),
        "bytes": pytest.approx(1e7),
        "basis": "the plan (results/plan.json), per prompt",
    }
    assert data_price(16, 4, per_sample) == {
        "samples": 48,
        "usd": pytest.approx(4.8),
        "node_hours": pytest.approx(0.48),
        "bytes": pytest.approx(4.8e8),
    }
    measured = {
        "responses": {"usage": {}, "throughput": {"seconds": 30.0}},
        "hidden_states": {"samples": 10, "bytes": 5000, "throughput": {"seconds": 6.0}},
    }
    run = per_sample_price([], [measured])
    assert run["usd"] is None and run["bytes"] == 500 and run["node_hours"] == pytest.approx(36 / 3600 / 10)
    fit = fit_curve(curve([15, 20, 25]), reps=50, ceiling=4.0)
    line = curve_line("chat", fit, [data_price(16, k, per_sample) for k in (2, 4)])
    # the slope is certain, the level is not: which prompts a resample draws moves every point alike
    assert line == (
        "chat: acceptance length 2.500 at 16 samples, +0.500 per doubling [+0.500, +0.500]; "
        "last step (8 to 16) +0.500 per doubling [+0.500, +0.500]; "
        "2x: 3.000 [2.850, 3.100] for 16 more samples: $1.60, 0.16 node-h, 152.59 MiB; "
        "4x: 3.500 [3.350, 3.600] for 48 more samples: $4.80, 0.48 node-h, 457.76 MiB"
    )
    assert verdict_words(fit, [data_price(16, k, per_sample) for k in (2, 4)]) == (
        "+0.500 per doubling of the samples [+0.500, +0.500]; at 2x: 3.000 [2.850, 3.100] for "
        "16 more samples: $1.60, 0.16 node-h, 152.59 MiB"
    )


def test_the_baselines_curve_is_said_after_the_regenerated_one_with_the_slopes_difference():
    """The drafts on the dataset's own responses (evaluate.baseline: original) at the same sizes: their
    curve in the console's line and the verdict's words, and how much more a doubling gives regenerated."""
    regenerated, original = curve([15, 20, 25]), curve([12, 13, 14])
    fit, baseline = fit_curve(regenerated, reps=50), fit_curve(original, reps=50)
    difference = slope_difference(regenerated, original, reps=50)
    words = baseline_words(baseline, difference)
    assert words == (
        "original responses 1.400 at 16 samples, +0.100 per doubling [+0.100, +0.100], "
        "regenerated minus original +0.400 per doubling [+0.400, +0.400]"
    )
    prices = [data_price(16, k, {"usd": None, "node_hours": None, "bytes": None}) for k in (2, 4)]
    line = curve_line("chat", fit, prices, baseline, difference)
    assert line.startswith("chat: acceptance length 2.500 at 16 samples, +0.500 per doubling") and line.endswith(
        f"for 48 more samples: no priced backend, no node-hours rate, - bytes; {words}"
    )
    assert curve_line("chat", fit, prices) == line.removesuffix(f"; {words}")


def test_the_points_come_from_the_drafts_figures_and_their_baselines():
    def figures(samples, accepted):
        per_prompt = [{"id": "p", "accepted": accepted}]
        return {
            "samples": samples,
            "per_prompt": per_prompt,
            "baseline": {"samples": samples, "per_prompt": per_prompt[:0] + [{"id": "p", "accepted": [0]}]},
        }

    points = points_of([figures(8, [1, 2]), figures(4, [0, 0])])
    assert points == [(4, {"p": (2, 2)}), (8, {"p": (5, 2)})]  # by samples; a step commits its bonus token
    assert points_of([figures(8, [1, 2])], baseline=True) == [(8, {"p": (1, 1)})]


def test_the_curves_training_subsets_are_nested_and_the_same_prompts_in_the_baselines_export(tmp_path):
    ids = [f"id{n}" for n in range(20)]
    subsets = [nested_subset(ids, f, seed=0, least=4) for f in (0.125, 0.25, 0.5, 1.0)]
    assert [len(s) for s in subsets] == [4, 5, 10, 20]  # at least a batch of 4
    assert subsets[0] < subsets[1] < subsets[2] < subsets[3]
    assert nested_subset(ids, 0.5, seed=1, least=4) != subsets[2]  # another seed, other samples

    def export(name: str, order: list[str]) -> object:
        root = tmp_path / name
        (root / "rows_000000000-000001000").mkdir(parents=True)
        (root / "draft_config.json").write_text("{}")
        (root / "ids.jsonl").write_text("".join(json.dumps({"index": n, "id": i}) + "\n" for n, i in enumerate(order)))
        for n in range(len(order)):
            (root / "rows_000000000-000001000" / f"data_{n:09d}.ckpt").write_text(order[n])
        return root

    # the twin (the dataset's own responses) numbers the same prompts otherwise
    regenerated, original = export("regenerated", ids), export("original", ids[::-1])
    chosen = []
    for name, source in (("r", regenerated), ("o", original)):
        data = training_data([source], tmp_path / name, fraction=0.25, seed=0, least=4)
        chosen.append({p.read_text() for p in data.rglob("*.ckpt")})
    assert chosen[0] == chosen[1] == subsets[1]
    assert training_data([regenerated], tmp_path / "whole") is None  # the whole export: read in place
