"""The report's figures: matplotlib PNGs as data URIs, which the template embeds, so the page is one file.

Figures are built with `matplotlib.figure.Figure` directly (no pyplot): no global state and no
display backend, which is what a batch job wants.
"""

from __future__ import annotations

import base64
import io
from typing import NamedTuple

from matplotlib.figure import Figure


class Plot(NamedTuple):
    """A figure as the template's `<img>` takes it: its alt text and its PNG as a data URI."""

    alt: str
    src: str


LENGTH_PANELS = (
    ("responses", "prompt_tokens", "prompt tokens per regenerated turn"),
    ("responses", "completion_tokens", "completion tokens per turn"),
    ("responses", "reasoning_chars", "reasoning characters per turn"),
    ("tokens", "sample_tokens", "tokens per training sample"),
    ("tokens", "loss_tokens", "trained (loss-masked) tokens per sample"),
)


def _img(fig: Figure, alt: str) -> Plot:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100, bbox_inches="tight")
    return Plot(alt, "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode())


def _edge_label(edge: int) -> str:
    """A power-of-two bin by its lower edge: the bin holds [edge, 2 * edge)."""
    if edge >= 1 << 20:
        return f"{edge >> 20}M"
    if edge >= 1 << 10:
        return f"{edge >> 10}k"
    return str(edge)


def _grouped_bars(ax, categories: list[str], series: dict[str, list[float]]) -> None:
    width = 0.8 / max(len(series), 1)
    for n, (name, values) in enumerate(series.items()):
        ax.bar([i + (n - (len(series) - 1) / 2) * width for i in range(len(categories))], values, width, label=name)
    ax.set_xticks(range(len(categories)), categories)


def lengths_figure(summaries: list[dict]) -> Plot:
    """Histograms on power-of-two bins (counts per bin), one bar group per partition."""
    fig = Figure(figsize=(15, 7.5), layout="constrained")
    axes = fig.subplots(2, 3).flat
    for ax, (stage, name, title) in zip(axes, LENGTH_PANELS, strict=False):
        hists = {s["partition"]: s[stage].get("lengths", {}).get(name, {}) for s in summaries}
        edges = sorted({int(k) for h in hists.values() for k in h})
        ax.set_title(title, fontsize=10)
        if not edges:
            ax.text(0.5, 0.5, "no data", ha="center", transform=ax.transAxes)
            continue
        _grouped_bars(
            ax, [_edge_label(e) for e in edges], {p: [h.get(str(e), 0) for e in edges] for p, h in hists.items()}
        )
        ax.tick_params(axis="x", labelrotation=60, labelsize=8)
        ax.set_xlabel("from (each bin doubles)", fontsize=8)
        ax.set_ylabel("count")
    last = list(fig.axes)[-1]
    last.axis("off")
    handles, labels = fig.axes[0].get_legend_handles_labels()
    last.legend(handles, labels, loc="center", title="partition")
    return _img(fig, "length histograms")


def _label(ax, title: str, legend: bool = True) -> None:
    ax.set_title(title, fontsize=10)
    ax.tick_params(axis="x", labelsize=8)
    if legend:
        ax.legend(fontsize=8)


def _stacked_shares(ax, names: list[str], counts: dict[str, list[int]], totals: list[int], title: str) -> None:
    """Bars of each partition's shares (counts / total), stacked to at most 1."""
    bottom = [0.0] * len(names)
    for label, values in counts.items():
        shares = [v / max(t, 1) for v, t in zip(values, totals, strict=True)]
        ax.bar(names, shares, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, shares, strict=True)]
    ax.set_ylim(0, 1)
    _label(ax, title)


def outcomes_figure(summaries: list[dict]) -> Plot:
    fig = Figure(figsize=(15, 4.2), layout="constrained")
    funnel, finish, audit = fig.subplots(1, 3)
    names = [s["partition"] for s in summaries]
    stages = {
        "records read": [s["prompts"].get("records", 0) for s in summaries],
        "prompts kept": [s["prompts"].get("prompts", 0) for s in summaries],
        "responses ok": [s["responses"]["status"].get("ok", 0) for s in summaries],
        "samples out": [s["tokens"].get("samples_out", 0) for s in summaries],
    }
    _grouped_bars(funnel, names, stages)
    _label(funnel, "kept at each stage (why dropped: the table)")

    reasons = sorted({r for s in summaries for r in s["responses"]["finish_reasons"]})
    _stacked_shares(
        finish,
        names,
        {r: [s["responses"]["finish_reasons"].get(r, 0) for s in summaries] for r in reasons},
        [sum(s["responses"]["finish_reasons"].values()) for s in summaries],
        "finish reasons (share of regenerated turns)",
    )
    _stacked_shares(
        audit,
        names,
        {
            k.replace("_", "-"): [s["tokens"]["audit"].get(k, 0) for s in summaries]
            for k in ("exact", "bpe_only", "semantic")
        },
        [s["tokens"]["audit"].get("turns_compared", 0) for s in summaries],
        "token audit vs server IDs (share of turns compared)",
    )
    return _img(fig, "outcomes")


def cost_figure(summaries: list[dict]) -> Plot:
    """Throughput and bytes, and the API cost where a backend priced any turn (no empty panel without)."""
    spent = [s["responses"]["usage"].get("cost", 0.0) for s in summaries]
    fig = Figure(figsize=(15 if any(spent) else 10, 4.2), layout="constrained")
    panels = list(fig.subplots(1, 3 if any(spent) else 2))
    names = [s["partition"] for s in summaries]
    if any(spent):
        cost = panels.pop(0)
        cost.bar(names, spent)
        _label(cost, "API cost (USD, as billed per turn)", legend=False)
    speed, size = panels

    rates = {
        "generation (completion tokens/s)": [
            s["responses"].get("throughput", {}).get("completion_tokens_per_s", 0.0) for s in summaries
        ],
        "hidden states (tokens/s)": [
            s["hidden_states"].get("throughput", {}).get("tokens_per_s", 0.0) for s in summaries
        ],
    }
    _grouped_bars(speed, names, rates)
    speed.set_yscale("symlog")
    _label(speed, "throughput per job")

    mib = 1 << 20
    sizes = {
        "on disk": [s["hidden_states"]["bytes"] / mib for s in summaries],
        "uncompressed": [s["hidden_states"].get("raw_bytes", s["hidden_states"]["bytes"]) / mib for s in summaries],
    }
    _grouped_bars(size, names, sizes)
    _label(size, "hidden-state bytes (MiB)")
    return _img(fig, "cost, throughput and bytes" if any(spent) else "throughput and bytes")


def agreement_by_position(probed: list[dict]) -> Plot:
    fig = Figure(figsize=(9, 3.6), layout="constrained")
    ax = fig.subplots()
    for s in probed:
        rows = [r for r in s["probe"]["by_position"] if r.get("positions")]
        ax.plot([r["position"] for r in rows], [r["top1_agreement"] for r in rows], marker=".", label=s["partition"])
    ax.set_ylim(0, 1.02)
    ax.set_xlabel("position in the response")
    ax.set_ylabel("top-1 agreement")
    ax.tick_params(axis="x", labelsize=7, labelrotation=90)
    ax.legend(fontsize=8)
    return _img(fig, "probe agreement by position")


def figures(summaries: list[dict]) -> list[tuple[str, Plot]]:
    return [
        ("Length distributions", lengths_figure(summaries)),
        ("Kept and dropped, finish reasons, token audit", outcomes_figure(summaries)),
        (
            "Cost, throughput and hidden-state bytes"
            if any(s["responses"]["usage"].get("cost") for s in summaries)
            else "Throughput and hidden-state bytes (no priced backend in this run)",
            cost_figure(summaries),
        ),
    ]


def evaluation_figure(evaluations: list[dict]) -> Plot:
    """Measured acceptance length per partition (its 95% interval as error bars), the draft trained on the
    dataset's original responses beside it where there is one; how often each draft position is accepted."""
    fig = Figure(figsize=(12, 4.2), layout="constrained")
    lengths, positions = fig.subplots(1, 2)
    names = [e["partition"] for e in evaluations]
    width = 0.4 if any(e["baseline"] for e in evaluations) else 0.8
    regenerated = [e["acceptance_length"] for e in evaluations]
    errors = [
        [max(0.0, e["acceptance_length"] - e["interval_95"][0]) for e in evaluations],
        [max(0.0, e["interval_95"][1] - e["acceptance_length"]) for e in evaluations],
    ]
    shift = -width / 2 if width < 0.8 else 0.0
    lengths.bar([i + shift for i in range(len(names))], regenerated, width, yerr=errors, capsize=3, label="regenerated")
    with_baseline = [(i, e["baseline"]["acceptance_length"]) for i, e in enumerate(evaluations) if e["baseline"]]
    if with_baseline:
        lengths.bar([i + width / 2 for i, _ in with_baseline], [v for _, v in with_baseline], width, label="original")
    lengths.set_xticks(range(len(names)), names)
    lengths.set_ylabel("tokens per verify step")
    _label(lengths, "acceptance length (95% interval)")
    for e in evaluations:
        by_position = e["acceptance_by_position"]
        positions.plot(range(1, len(by_position) + 1), by_position, marker="o", label=e["partition"])
    positions.set_ylim(0, 1.02)
    positions.set_xlabel("draft position")
    positions.set_ylabel("share of verify steps accepting it")
    positions.xaxis.get_major_locator().set_params(integer=True)
    _label(positions, "acceptance by draft position")
    return _img(fig, "acceptance length per partition and by draft position")


def curve_figure(curves: list[dict]) -> Plot:
    """Acceptance length against training samples (log2 axis) per partition and for the mix: each draft with
    its 95% interval, the fitted line carried to 4x the data (dashed, its interval shaded), and the drafts
    trained on the dataset's own responses at the same sizes (hollow markers) where there are any."""
    fig = Figure(figsize=(8, 4.5), layout="constrained")
    ax = fig.subplots()
    drawn = []  # each curve's handle and label, its baseline's after it (matplotlib lists lines first)
    for number, c in enumerate(curves):
        color = f"C{number % 10}"
        points = c["curve"]["points"]
        xs = [p["samples"] for p in points]
        ys = [p["acceptance_length"] for p in points]
        errors = [
            [max(0.0, p["acceptance_length"] - p["interval_95"][0]) for p in points],
            [max(0.0, p["interval_95"][1] - p["acceptance_length"]) for p in points],
        ]
        drawn.append((ax.errorbar(xs, ys, yerr=errors, marker="o", capsize=3, color=color), c["partition"]))
        ahead = c["curve"]["extrapolated"]
        ax.plot(
            [xs[-1], *(a["samples"] for a in ahead)],
            [ys[-1], *(a["acceptance_length"] for a in ahead)],
            "--",
            color=color,
        )
        ax.fill_between(
            [a["samples"] for a in ahead],
            [a["interval_95"][0] for a in ahead],
            [a["interval_95"][1] for a in ahead],
            color=color,
            alpha=0.15,
        )
        if b := c["baseline"]:
            (line,) = ax.plot(
                [p["samples"] for p in b["points"]],
                [p["acceptance_length"] for p in b["points"]],
                marker="o",
                markerfacecolor="none",
                linestyle=":",
                color=color,
            )
            drawn.append((line, f"{c['partition']}, original responses"))
    ax.set_xscale("log", base=2)
    ax.set_xlabel("training samples (log2; dashed: the fit carried to 2x and 4x)")
    ax.set_ylabel("acceptance length")
    _label(ax, "acceptance length against training samples (95% intervals)", legend=False)
    ax.legend(*zip(*drawn, strict=True), fontsize=8)
    # the alt text names each curve drawn, in the legend's order
    return _img(fig, "acceptance length against training samples: " + "; ".join(label for _, label in drawn))
