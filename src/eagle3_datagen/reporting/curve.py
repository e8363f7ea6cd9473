"""The data curve: acceptance length against the number of training samples (evaluate.fractions), its fit
against log2(samples), the gain of the last doubling, and what 2x and 4x the data would give and cost.

Every point of a curve is a draft decoded on the same held-out prompts, so the intervals come from one
paired percentile bootstrap over those prompts: each resample picks prompts once and recomputes every
point's acceptance length on them (summed committed tokens / summed verify steps, as SGLang's), then the
least-squares line through the points. A prompt's length and difficulty move every point alike and cancel
in the slope, which is what the question (does more data help?) turns on.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence

from eagle3_datagen.paired_acceptance import prompt_figures

METHOD = (
    "least squares of acceptance length on log2(samples); 95% intervals: paired percentile bootstrap over the "
    "held-out prompts (each resample refits the line through every point)"
)
FACTORS = (2, 4)
Figures = Mapping[str, tuple[int, int]]  # {prompt id: (committed tokens, verify steps)}


def _ratio(figures: Figures, ids: Sequence[str]) -> float:
    steps = sum(figures[i][1] for i in ids)
    return sum(figures[i][0] for i in ids) / steps if steps else math.nan


def _line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """(intercept, slope) of the least-squares line."""
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
    return my - slope * mx, slope


def _percentiles(values: list[float]) -> list[float]:
    values = sorted(v for v in values if not math.isnan(v))
    return [values[int(0.025 * (len(values) - 1))], values[int(0.975 * (len(values) - 1))]]


def points_of(evaluations: Sequence[Mapping], baseline: bool = False) -> list[tuple[int, Figures]]:
    """(samples, per-prompt figures) of each draft (acceptance.json and curve/*.json), or of the draft
    trained on the dataset's own responses beside each (`baseline`), by samples."""
    figures = [e["baseline"] if baseline else e for e in evaluations]
    return sorted((f["samples"], prompt_figures(f["per_prompt"])) for f in figures)


def fit_curve(
    points: Sequence[tuple[int, Figures]], reps: int = 2000, seed: int = 0, ceiling: float | None = None
) -> dict | None:
    """The curve of `points` (samples, per-prompt figures on the same prompts): each point's acceptance
    length and interval, the line's gain per doubling of the samples, the last doubling's measured gain
    (between the two largest points, per doubling), and the line extrapolated to 2x and 4x the largest
    point's samples (at most `ceiling`: num_steps + 1, every proposal accepted). None with fewer than two
    distinct sample counts (no line)."""
    if len({n for n, _ in points}) < 2:
        return None
    ids = sorted(set.intersection(*(set(f) for _, f in points)))
    if not ids:
        raise ValueError("the curve's drafts were decoded on different held-out prompts: no point to pair")
    xs = [math.log2(n) for n, _ in points]
    top = points[-1][0]
    (n0, f0), (n1, f1) = points[-2], points[-1]

    def figures(picked: Sequence[str]) -> dict:
        ys = [_ratio(f, picked) for _, f in points]
        intercept, slope = _line(xs, ys)
        ahead = [intercept + slope * math.log2(top * k) for k in FACTORS]
        return {
            "ys": ys,
            "slope": slope,
            "last": (_ratio(f1, picked) - _ratio(f0, picked)) / math.log2(n1 / n0) if n1 > n0 else math.nan,
            "ahead": [min(a, ceiling) if ceiling else a for a in ahead],
        }

    whole = figures(ids)
    rng = random.Random(seed)
    resamples = [figures([ids[rng.randrange(len(ids))] for _ in ids]) for _ in range(reps)]
    return {
        "points": [
            {"samples": n, "acceptance_length": y, "interval_95": _percentiles([r["ys"][i] for r in resamples])}
            for i, ((n, _), y) in enumerate(zip(points, whole["ys"], strict=True))
        ],
        "gain_per_doubling": whole["slope"],
        "gain_per_doubling_interval_95": _percentiles([r["slope"] for r in resamples]),
        "last_doubling": {
            "from_samples": n0,
            "to_samples": n1,
            "gain": whole["last"],
            "interval_95": _percentiles([r["last"] for r in resamples]) if n1 > n0 else None,
        },
        "extrapolated": [
            {
                "factor": k,
                "samples": top * k,
                "acceptance_length": whole["ahead"][j],
                "interval_95": _percentiles([r["ahead"][j] for r in resamples]),
            }
            for j, k in enumerate(FACTORS)
        ],
        "ceiling": ceiling,
        "prompts": len(ids),
        "reps": reps,
        "seed": seed,
        "method": METHOD,
    }


def slope_difference(
    first: Sequence[tuple[int, Figures]], second: Sequence[tuple[int, Figures]], reps: int = 2000, seed: int = 0
) -> dict:
    """The gain per doubling of `first`'s curve minus `second`'s and its 95% interval: a paired bootstrap
    where both were decoded on the same prompts, else each curve's prompts resampled on their own."""
    ids = [sorted(set.intersection(*(set(f) for _, f in points))) for points in (first, second)]
    paired = ids[0] == ids[1]

    def slope(points, picked):
        return _line([math.log2(n) for n, _ in points], [_ratio(f, picked) for _, f in points])[1]

    rng = random.Random(seed)
    differences = []
    for _ in range(reps):
        picks = [[i[rng.randrange(len(i))] for _ in i] for i in ids]
        differences.append(slope(first, picks[0]) - slope(second, picks[1] if not paired else picks[0]))
    return {
        "difference": slope(first, ids[0]) - slope(second, ids[1]),
        "interval_95": _percentiles(differences),
        "paired": paired,
        "reps": reps,
    }


def data_price(samples: int, factor: int, per_sample: Mapping[str, float | None]) -> dict:
    """What (`factor` - 1) * `samples` more samples cost at `per_sample`'s dollars, node-hours and bytes
    (None where nothing prices it)."""
    more = (factor - 1) * samples
    return {
        "samples": more,
        **{k: (v * more if v is not None else None) for k, v in per_sample.items() if k != "basis"},
    }


def per_sample_price(plan_rows: Sequence[Mapping], summaries: Sequence[Mapping]) -> dict:
    """Dollars, node-hours and hidden-state bytes per sample: the plan's (results/plan.json, written by
    scripts/plan.py before the run) where it counted these partitions, else what the run measured (the
    billed cost and the bytes written; job hours, not node-hours, from the jobs' own seconds)."""
    if plan_rows and len(plan_rows) == len(summaries):
        prompts = sum(r["prompts"] for r in plan_rows)

        def total(*keys):
            known = [r[k] for r in plan_rows for k in keys if r.get(k) is not None]
            return sum(known) / prompts if known and prompts else None

        return {
            "usd": total("cost_usd"),
            "node_hours": total("generation_node_hours", "hidden_node_hours"),
            "bytes": total("hidden_bytes"),
            "basis": "the plan (results/plan.json), per prompt",
        }
    samples = sum(s["hidden_states"]["samples"] for s in summaries)
    if not samples:
        return {"usd": None, "node_hours": None, "bytes": None, "basis": "nothing measured"}
    seconds = sum(
        s["responses"].get("throughput", {}).get("seconds", 0)
        + s["hidden_states"].get("throughput", {}).get("seconds", 0)
        for s in summaries
    )
    cost = sum(s["responses"]["usage"].get("cost", 0.0) for s in summaries)
    return {
        "usd": cost / samples if cost else None,
        "node_hours": seconds / 3600 / samples,
        "bytes": sum(s["hidden_states"]["bytes"] for s in summaries) / samples,
        "basis": "measured in this run (no plan counted these partitions): billed cost, job hours, bytes written",
    }


def curve_line(
    name: str, curve: dict, prices: Sequence[dict], baseline: dict | None = None, difference: dict | None = None
) -> str:
    """The curve said in one line (the console's and the report's), the baseline's after it where the run
    had one (`baseline_words`)."""
    last = curve["points"][-1]
    slope_low, slope_high = curve["gain_per_doubling_interval_95"]
    parts = [
        f"{name}: acceptance length {last['acceptance_length']:.3f} at {last['samples']} samples, "
        f"{curve['gain_per_doubling']:+.3f} per doubling [{slope_low:+.3f}, {slope_high:+.3f}]"
    ]
    step = curve["last_doubling"]
    if step["interval_95"]:
        parts.append(
            f"last step ({step['from_samples']} to {step['to_samples']}) {step['gain']:+.3f} per doubling "
            f"[{step['interval_95'][0]:+.3f}, {step['interval_95'][1]:+.3f}]"
        )
    for ahead, price in zip(curve["extrapolated"], prices, strict=True):
        low, high = ahead["interval_95"]
        parts.append(
            f"{ahead['factor']}x: {ahead['acceptance_length']:.3f} [{low:.3f}, {high:.3f}] for {price_words(price)}"
        )
    if baseline:
        parts.append(baseline_words(baseline, difference))
    return "; ".join(parts)


def baseline_words(baseline: dict, difference: dict | None = None) -> str:
    """The baseline's curve (the same drafts trained on the dataset's own responses of the same prompts) in
    words: its largest draft, its gain per doubling, and the regenerated curve's gain per doubling minus
    its (`slope_difference`): what regenerating the data pays as the data grows."""
    last = baseline["points"][-1]
    low, high = baseline["gain_per_doubling_interval_95"]
    words = (
        f"original responses {last['acceptance_length']:.3f} at {last['samples']} samples, "
        f"{baseline['gain_per_doubling']:+.3f} per doubling [{low:+.3f}, {high:+.3f}]"
    )
    if difference:
        low, high = difference["interval_95"]
        words += f", regenerated minus original {difference['difference']:+.3f} per doubling [{low:+.3f}, {high:+.3f}]"
    return words


def verdict_words(curve: dict, prices: Sequence[dict]) -> str:
    """The curve in a few words (the report's verdict): the gain per doubling and what 2x the data gives."""
    low, high = curve["gain_per_doubling_interval_95"]
    ahead, price = curve["extrapolated"][0], prices[0]
    return (
        f"{curve['gain_per_doubling']:+.3f} per doubling of the samples [{low:+.3f}, {high:+.3f}]; at 2x: "
        f"{ahead['acceptance_length']:.3f} [{ahead['interval_95'][0]:.3f}, {ahead['interval_95'][1]:.3f}] for "
        f"{price_words(price)}"
    )


def price_words(price: dict) -> str:
    """A `data_price` in words: its samples, dollars, node-hours and bytes."""
    money, hours = _money(price["usd"]), _hours(price["node_hours"])
    return f"{price['samples']} more samples: {money}, {hours}, {_bytes(price['bytes'])}"


def _money(value: float | None) -> str:
    return "no priced backend" if value is None else f"${value:,.2f}"


def _hours(value: float | None) -> str:
    return "no node-hours rate" if value is None else f"{value:,.3g} node-h"


def _bytes(value: float | None) -> str:
    if value is None:
        return "- bytes"
    for scale, unit in ((1 << 40, "TiB"), (1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")):
        if value >= scale:
            return f"{value / scale:.2f} {unit}"
    return f"{value:.0f} B"
