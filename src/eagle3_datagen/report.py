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


def partition_summary(
    name: str, prompt_stats: str, response_stats: list[str], audits: list[str], hidden_dirs: list[str]
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
    }


def _flat(prefix: str, value) -> list[tuple[str, str]]:
    if isinstance(value, dict):
        return [row for k, v in value.items() for row in _flat(f"{prefix}.{k}" if prefix else k, v)]
    if isinstance(value, float):
        return [(prefix, f"{value:.4g}")]
    return [(prefix, str(value))]


def summary_html(summaries: list[dict]) -> str:
    keys = [k for k, _ in _flat("", {k: v for k, v in summaries[0].items() if k != "partition"})]
    keys = [k for k in keys if not k.startswith(("tokens.special_tokens", "tokens.audit.examples"))]
    head = "".join(f"<th>{html.escape(s['partition'])}</th>" for s in summaries)
    values = [dict(_flat("", s)) for s in summaries]
    rows = "".join(
        f"<tr><td>{html.escape(k)}</td>" + "".join(f"<td>{html.escape(v.get(k, ''))}</td>" for v in values) + "</tr>"
        for k in keys
    )
    return (
        "<html><head><meta charset='utf-8'><title>eagle3-datagen summary</title></head><body>"
        "<h1>eagle3-datagen: per-partition summary</h1>"
        f"<table border='1' cellpadding='3'><tr><th>metric</th>{head}</tr>{rows}</table></body></html>\n"
    )


def write_partition_summary(out: str, **kwargs) -> dict:
    summary = partition_summary(**kwargs)
    write_json(out, summary)
    return summary
