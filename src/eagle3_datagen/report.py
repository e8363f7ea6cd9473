"""Per-partition statistics gathered from every stage's own counts, and an HTML summary."""

from __future__ import annotations

import html
from collections import Counter
from pathlib import Path

from .io import read_json, write_json


def _merge(dicts: list[dict]) -> dict:
    total: Counter = Counter()
    for d in dicts:
        total.update({k: v for k, v in d.items() if isinstance(v, int | float) and not isinstance(v, bool)})
    return dict(sorted(total.items()))


def _pooled(parts: list[dict]) -> dict:
    """Probe statistics of several shards pooled, weighted by positions probed."""
    parts = [p for p in parts if p.get("positions")]
    n = sum(p["positions"] for p in parts)
    if not n:
        return {"positions": 0}
    keys = ("top1_agreement", "mean_logprob", "outside_top5")
    return {"positions": n, **{k: sum(p[k] * p["positions"] for p in parts) / n for k in keys}}


def probe_summary(probes: list[dict]) -> dict:
    if not probes:
        return {}
    scopes = ("all", "last_turn", "earlier_turns", "last_turn_first_positions")
    labels = [row["position"] for row in probes[0]["by_position"]]
    return {
        "backend": sorted({p["backend"] for p in probes}),
        "greedy_exact": all(p["greedy_exact"] for p in probes),
        "verdicts": dict(Counter(p["verdict"] for p in probes)),
        "positions_probed": sum(p["positions_probed"] for p in probes),
        "positions_total": sum(p["positions_total"] for p in probes),
        **{scope: _pooled([p[scope] for p in probes]) for scope in scopes},
        "by_position": [
            {"position": label, **_pooled([p["by_position"][i] for p in probes])} for i, label in enumerate(labels)
        ],
    }


def partition_summary(
    name: str,
    prompt_stats: str,
    response_stats: list[str],
    audits: list[str],
    hidden_dirs: list[str],
    probes: list[str] = (),
) -> dict:
    prompts = read_json(prompt_stats)
    responses = [read_json(p) for p in response_stats]
    audit_reports = [read_json(p) for p in audits]
    indexes = [read_json(Path(d) / "index.json") for d in hidden_dirs]
    audit = _merge([a["audit"] for a in audit_reports])
    compared = audit.get("turns_compared", 0)
    return {
        "partition": name,
        "prompts": {k: v for k, v in prompts.items() if k != "per_shard"},
        "responses": {
            "backend": sorted({r["backend"] for r in responses}),
            "status": _merge([r["status"] for r in responses]),
            "finish_reasons": _merge([r["finish_reasons"] for r in responses]),
            "usage": _merge([r["usage"] for r in responses]),
        },
        "tokens": {
            **_merge([a["counts"] for a in audit_reports]),
            "audit": {
                **{k: v for k, v in audit.items() if not k.endswith("_rate")},
                "semantic_rate": audit.get("semantic", 0) / compared if compared else 0.0,
                "bpe_only_rate": audit.get("bpe_only", 0) / compared if compared else 0.0,
            },
            "special_tokens": audit_reports[0]["special_tokens"] if audit_reports else {},
        },
        "hidden_states": {
            "samples": sum(i["samples"] for i in indexes),
            "tokens": sum(i["tokens"] for i in indexes),
            "loss_tokens": sum(i["loss_tokens"] for i in indexes),
            "bytes": sum(i["bytes"] for i in indexes),
            "parts": sum(len(i["parts"]) for i in indexes),
            "aux_layers": indexes[0]["aux_layers"] if indexes else None,
            "final": indexes[0]["final"] if indexes else None,
            "nonfinite": sum(len(i["nonfinite_ids"]) for i in indexes),
        },
        "probe": probe_summary([read_json(p) for p in probes]),
    }


def _flat(prefix: str, value) -> list[tuple[str, str]]:
    if isinstance(value, dict):
        return [row for k, v in value.items() for row in _flat(f"{prefix}.{k}" if prefix else k, v)]
    if isinstance(value, float):
        return [(prefix, f"{value:.4g}")]
    return [(prefix, str(value))]


def summary_html(summaries: list[dict]) -> str:
    keys = [k for k, _ in _flat("", {k: v for k, v in summaries[0].items() if k != "partition"})]
    hidden = ("tokens.special_tokens", "tokens.audit.examples", "probe.by_position")
    keys = [k for k in keys if not k.startswith(hidden)]
    head = "".join(f"<th>{html.escape(s['partition'])}</th>" for s in summaries)
    values = [dict(_flat("", s)) for s in summaries]
    rows = "".join(
        f"<tr><td>{html.escape(k)}</td>" + "".join(f"<td>{html.escape(v.get(k, ''))}</td>" for v in values) + "</tr>"
        for k in keys
    )
    return (
        "<html><head><meta charset='utf-8'><title>eagle3-datagen summary</title></head><body>"
        "<h1>eagle3-datagen: per-partition summary</h1>"
        f"<table border='1' cellpadding='3'><tr><th>metric</th>{head}</tr>{rows}</table>"
        f"{probe_section(summaries)}</body></html>\n"
    )


PLOT_COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b")


def agreement_plot(summaries: list[dict], width: int = 640, height: int = 240) -> str:
    """Inline SVG: top-1 agreement by position in the response, one line per partition."""
    series = [(s["partition"], s["probe"]["by_position"]) for s in summaries if s.get("probe")]
    if not series:
        return ""
    count = max(len(rows) for _, rows in series)
    pad = 40

    def x(i: int) -> float:
        return pad + i * (width - 2 * pad) / max(count - 1, 1)

    def y(v: float) -> float:
        return height - pad - v * (height - 2 * pad)

    parts = [
        f"<svg xmlns='http://www.w3.org/2000/svg' width='{width}' height='{height}' class='agreement-plot'>",
        f"<line x1='{pad}' y1='{y(0)}' x2='{width - pad}' y2='{y(0)}' stroke='black'/>",
        f"<line x1='{pad}' y1='{y(0)}' x2='{pad}' y2='{y(1)}' stroke='black'/>",
        f"<text x='{pad - 30}' y='{y(1) + 4}' font-size='11'>1.0</text>",
        f"<text x='{pad - 30}' y='{y(0) + 4}' font-size='11'>0.0</text>",
        f"<text x='{width / 2 - 90}' y='{height - 8}' font-size='11'>position in the response</text>",
    ]
    for n, (name, rows) in enumerate(series):
        colour = PLOT_COLOURS[n % len(PLOT_COLOURS)]
        points = " ".join(f"{x(i):.1f},{y(r['top1_agreement']):.1f}" for i, r in enumerate(rows) if r.get("positions"))
        parts.append(f"<polyline fill='none' stroke='{colour}' stroke-width='1.5' points='{points}'/>")
        parts.append(f"<text x='{width - pad + 4}' y='{pad + 14 * n}' font-size='11' fill='{colour}'>")
        parts.append(f"{html.escape(name)}</text>")
    parts.append("</svg>")
    return "".join(parts)


def probe_section(summaries: list[dict]) -> str:
    probed = [s for s in summaries if s.get("probe")]
    if not probed:
        return ""
    rows = "".join(
        f"<tr><td>{html.escape(s['partition'])}</td><td>{html.escape(', '.join(s['probe']['backend']))}</td>"
        f"<td>{s['probe']['greedy_exact']}</td>"
        + "".join(
            f"<td>{s['probe'][scope].get('top1_agreement', float('nan')):.4f}</td>"
            for scope in ("last_turn", "last_turn_first_positions", "earlier_turns")
        )
        + f"<td>{s['probe']['all'].get('mean_logprob', float('nan')):.3f}</td>"
        f"<td>{s['probe']['all'].get('outside_top5', float('nan')):.4f}</td>"
        f"<td>{html.escape(str(s['probe']['verdicts']))}</td></tr>"
        for s in probed
    )
    return (
        "<h2>Probe: the target's LM head on the stored final states</h2>"
        "<table border='1' cellpadding='3'><tr><th>partition</th><th>backend</th><th>greedy, exact IDs</th>"
        "<th>top-1 agreement, last turns</th><th>first positions</th><th>earlier turns</th>"
        "<th>mean log-prob</th><th>outside top-5</th><th>verdicts</th></tr>"
        f"{rows}</table><h3>Top-1 agreement by position in the response</h3>{agreement_plot(probed)}"
    )


def write_partition_summary(out: str, **kwargs) -> dict:
    summary = partition_summary(**kwargs)
    write_json(out, summary)
    return summary
