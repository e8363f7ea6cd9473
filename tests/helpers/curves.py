"""A finished run's data curves beside its baseline's (evaluate.fractions with evaluate.baseline: original),
read back from the run's own files: the drafts' figures, results/report/curves.json, the report's page and
what the run printed."""

import html
import json
import re
from itertools import pairwise
from pathlib import Path

import pytest
from markupsafe import escape


def curves_beside_baselines(work: Path, names: list[str], fractions: list[float], console: str) -> dict[str, dict]:
    """Each curve of `names` (partitions, and `all` for the mix) in curves.json: its points and its baseline's
    are its drafts' (one per fraction, curve/{fraction}.json and acceptance.json at 1: samples and acceptance
    length, each inside its interval), the regenerated curve's gain per doubling minus the baseline's is the
    stated difference, and the report says both (the verdict card, the curve table's row, the plot's alt
    text naming each curve) as does the console (`console`: what the run printed). Returns the curves."""
    curves = {c["partition"]: c for c in json.loads((work / "results/report/curves.json").read_text())}
    assert sorted(curves) == sorted(names)
    page = (work / "results/report/summary.html").read_text()
    alt = re.search(r"alt='(acceptance length against training samples: [^']*)'", page)[1]
    for name in names:
        evaluate = work / ("results/evaluate" if name == "all" else f"results/{name}/evaluate")
        drafts = [json.loads((evaluate / "curve" / f"{f}.json").read_text()) for f in sorted(fractions) if f < 1]
        drafts.append(json.loads((evaluate / "acceptance.json").read_text()))
        c = curves[name]
        for key, figures in (("curve", drafts), ("baseline", [d["baseline"] for d in drafts])):
            points = c[key]["points"]
            assert [p["samples"] for p in points] == [f["samples"] for f in figures], (name, key)
            assert [p["acceptance_length"] for p in points] == pytest.approx([f["acceptance_length"] for f in figures])
            assert all(p["interval_95"][0] <= p["acceptance_length"] <= p["interval_95"][1] for p in points)
            assert c[key]["prompts"] == drafts[-1]["prompts"]  # every draft decoded on the same held-out prompts
        # a fraction trains on fewer samples, the same prompts' in the baseline's (its twin drops none of them)
        assert all(a["samples"] < b["samples"] for a, b in pairwise(drafts)), name
        assert all(d["samples"] <= d["baseline"]["samples"] for d in drafts), name
        difference = c["baseline_difference"]
        assert difference["paired"] and difference["difference"] == pytest.approx(
            c["curve"]["gain_per_doubling"] - c["baseline"]["gain_per_doubling"]
        )
        assert difference["interval_95"][0] <= difference["difference"] <= difference["interval_95"][1]
        assert c["line"].endswith(c["baseline_brief"]) and c["line"] in console
        assert escape(c["line"] if name == "all" else c["baseline_brief"]) in page, name
        row = ", ".join(f"{p['samples']}: {p['acceptance_length']:.3f}" for p in c["baseline"]["points"])
        assert f"<td>{row}; {c['baseline']['gain_per_doubling']:+.3f} [" in page, name
        assert f"{name}; {name}, original responses" in html.unescape(alt), alt
    return curves
