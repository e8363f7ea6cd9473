"""Per-partition statistics gathered from every stage's own counts, and an HTML summary."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import jinja2

from eagle3_datagen.chat.gates import GATES, UNUSABLE, pooled
from eagle3_datagen.formats.files import iter_jsonl, read_json, write_json
from eagle3_datagen.formats.histograms import merge
from eagle3_datagen.formats.storage import shard_bytes_per_token
from eagle3_datagen.reporting import curve
from eagle3_datagen.reporting import plots as report_plots


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


def _lengths(reports: list[dict]) -> dict:
    names = sorted({name for r in reports for name in r.get("lengths", {})})
    return {name: merge(r.get("lengths", {}).get(name, {}) for r in reports) for name in names}


def _rate(throughputs: list[dict], amount: str) -> dict:
    """Summed over jobs: `amount` per second of job time (jobs running side by side count separately)."""
    seconds = sum(t.get("seconds", 0) for t in throughputs)
    done = sum(t.get(amount, 0) for t in throughputs)
    return {"seconds": round(seconds, 3), amount: done, f"{amount}_per_s": done / seconds if seconds else 0.0}


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
        # the source's files stay in the prompt stats: a hub dataset's may be thousands
        "prompts": {k: v for k, v in prompts.items() if k not in ("per_shard", "files")},
        "responses": {
            "backend": sorted({r["backend"] for r in responses}),
            "status": _merge([r["status"] for r in responses]),
            "finish_reasons": _merge([r["finish_reasons"] for r in responses]),
            # calls regenerated, matched with the recorded ones, diverged; recorded results reused
            "tool_calls": _merge([r.get("tool_calls", {}) for r in responses]),
            "ended": _merge([r.get("ended", {}) for r in responses]),
            "usage": _merge([r["usage"] for r in responses]),
            "throughput": _rate([r.get("throughput", {}) for r in responses], "completion_tokens"),
            "lengths": _lengths(responses),
        },
        # what the quality gates dropped, each gate's count and rate over the partition's response rows
        "gates": pooled(a["gates"] for a in audit_reports if "gates" in a),
        "tokens": {
            **_merge([a["counts"] for a in audit_reports]),
            "audit": {
                **{k: v for k, v in audit.items() if not k.endswith("_rate")},
                "semantic_rate": audit.get("semantic", 0) / compared if compared else 0.0,
                "bpe_only_rate": audit.get("bpe_only", 0) / compared if compared else 0.0,
            },
            "special_tokens": audit_reports[0]["special_tokens"] if audit_reports else {},
            "lengths": _lengths(audit_reports),
        },
        "hidden_states": {
            "samples": sum(i["samples"] for i in indexes),
            "tokens": sum(i["tokens"] for i in indexes),
            "loss_tokens": sum(i["loss_tokens"] for i in indexes),
            "bytes": sum(i["bytes"] for i in indexes),
            "raw_bytes": sum(i.get("raw_bytes", i["bytes"]) for i in indexes),
            **storage_summary(indexes),
            "throughput": _rate([i.get("throughput", {}) for i in indexes], "tokens"),
            "parts": sum(len(i["parts"]) for i in indexes),
            "aux_layers": indexes[0]["aux_layers"] if indexes else None,
            "final": indexes[0]["final"] if indexes else None,
            "nonfinite": sum(len(i["nonfinite_ids"]) for i in indexes),
        },
        "probe": probe_summary([read_json(p) for p in probes]),
    }


def storage_summary(indexes: list[dict]) -> dict:
    """How the partition's states are stored, bytes on disk per token and their ratio to bf16."""
    if not indexes:
        return {}
    tokens = sum(i["tokens"] for i in indexes)
    on_disk = sum(i["bytes"] for i in indexes)
    # the storage module's arithmetic, not the codec's: the summary jobs then never import torch
    bf16 = sum(
        i["tokens"] * shard_bytes_per_token("bfloat16", "token", 0, len(i["aux_layers"]), i["hidden_size"])
        for i in indexes
    )
    first = indexes[0]
    return {
        "dtype": first["dtype"],
        "scales": (first.get("scales") or {}).get("granularity", "-"),
        "compress": (first.get("compress") or {}).get("codec", "none"),
        "bytes_per_token": on_disk / tokens if tokens else 0.0,
        "ratio_to_bf16": on_disk / bf16 if bf16 else 0.0,
    }


def _flat(prefix: str, value) -> list[tuple[str, str]]:
    if isinstance(value, dict):
        return [row for k, v in value.items() for row in _flat(f"{prefix}.{k}" if prefix else k, v)]
    if isinstance(value, float):
        return [(prefix, f"{value:.4g}")]
    return [(prefix, str(value))]


def shared_prompts(shard_paths: list[str], shard_counts: list) -> dict:
    """Prompts (same content id) that partitions share: per partition, how many of its prompts are
    also in another one, and per pair of partitions how many they have in common.

    `shard_counts` ([[partition, shards], ...]) says which of `shard_paths`, in order, are whose.
    """
    if sum(count for _, count in shard_counts) != len(shard_paths):
        raise ValueError(f"{len(shard_paths)} prompt shards, but the shard counts {shard_counts} add up otherwise")
    ids, at = {}, 0
    for name, count in shard_counts:
        ids[name] = {p["id"] for path in shard_paths[at : at + count] for _, p in iter_jsonl(path)}
        at += count
    names = sorted(ids)
    return {
        "per_partition": {a: len(ids[a] & set().union(*(ids[b] for b in names if b != a))) for a in names},
        "pairs": {f"{a} & {b}": len(ids[a] & ids[b]) for i, a in enumerate(names) for b in names[i + 1 :]},
    }


_TEMPLATES = jinja2.Environment(
    loader=jinja2.PackageLoader("eagle3_datagen.reporting", "templates"),
    autoescape=True,
    undefined=jinja2.StrictUndefined,
    keep_trailing_newline=True,
)


def summary_html(
    summaries: list[dict],
    shared: dict | None = None,
    evaluations: Sequence[dict] = (),
    curves: Sequence[dict] = (),
) -> str:
    """One self-contained page that leads with each partition's verdict, then the plots (they shrink to the
    window), then the tables, every number last and folded away.

    `evaluations`: the partitions' evaluation figures (acceptance.json), where the workflow evaluated them;
    `curves`: `data_curves`' (the data curve of each, where evaluate.fractions gives one)."""
    # Every key any partition has (a reason counted in one partition only is a row too), in first-seen order.
    flat = [k for s in summaries for k, _ in _flat("", {k: v for k, v in s.items() if k != "partition"})]
    keys = list(dict.fromkeys(flat))
    # Distributions are plotted; special tokens and audit examples stay in the partition JSON.
    plotted = ("responses.lengths", "tokens.lengths", "probe.by_position")
    untabled = (*plotted, "tokens.special_tokens", "tokens.audit.examples")
    keys = [k for k in keys if not k.startswith(untabled)]
    values = [dict(_flat("", s)) for s in summaries]
    evaluated = {e["partition"]: evaluation_figures(e) for e in evaluations}
    curved = {c["partition"]: c for c in curves}
    return _TEMPLATES.get_template("summary.html.j2").render(
        verdicts=[verdict(s, evaluated.get(s["partition"]), curved.get(s["partition"])) for s in summaries],
        mix=curved.get("all"),
        figures=report_plots.figures(summaries),
        gates=gates_section(summaries),
        probe=probe_section(summaries),
        evaluation=evaluation_section(list(evaluated.values())),
        curve=curve_section(list(curves)),
        shared=shared_rows(shared),
        partitions=[s["partition"] for s in summaries],
        numbers=[[k, *(v.get(k, "") for v in values)] for k in keys],
    )


def verdict(summary: dict, evaluation: dict | None, curve: dict | None) -> dict:
    """What a reader needs first of a partition, in words: how many samples it kept and what dropped the
    rest, whether its data is the target's own (the probe, the token audit), the draft's acceptance length
    and its curve, and what it cost."""
    gates, tokens = summary.get("gates") or {}, summary["tokens"]
    reasons = sorted(((n, r) for r, n in (gates.get("counts") or {}).items() if n), reverse=True)
    not_ok = {k: v for k, v in summary["responses"]["status"].items() if k != "ok" and v}
    probe, audit = summary.get("probe") or {}, tokens["audit"]
    compared = audit.get("turns_compared", 0)
    aligned = []
    if probe:
        top1 = probe.get("last_turn", {}).get("top1_agreement")
        aligned.append(
            f"probe {', '.join(f'{k} {v}' for k, v in probe['verdicts'].items())}"
            + (f", top-1 agreement {top1:.3f} on last turns" if top1 is not None else "")
        )
    if compared:
        aligned.append(f"{audit.get('exact', 0)}/{compared} turns' tokens exactly the server's")
    cost = summary["responses"]["usage"].get("cost")
    spent = [f"${cost:,.2f} billed"] if cost else []
    spent.append(f"{_size(summary['hidden_states']['bytes'])} of hidden states")
    acceptance = None
    if evaluation:
        acceptance = f"{evaluation['acceptance_length']:.3f} {_interval(evaluation['interval_95'])}"
        if b := evaluation["baseline"]:
            acceptance += (
                f"; {b['difference']:+.3f} {_interval(b['difference_interval_95'])} over the original responses"
            )
    return {
        "partition": summary["partition"],
        "kept": f"{tokens.get('samples_out', 0)} samples of {summary['prompts'].get('records', 0)} records",
        "dropped": ", ".join(f"{r} {n}" for n, r in reasons)
        or ", ".join(f"{k} {v}" for k, v in not_ok.items())
        or "none",
        "aligned": "; ".join(aligned) or "not probed",
        "acceptance": acceptance,
        "curve": curve["brief"] if curve else None,
        "baseline_curve": curve["baseline_brief"] if curve else None,
        "cost": ", ".join(spent),
    }


def _size(value: float) -> str:
    for scale, unit in ((1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")):
        if value >= scale:
            return f"{value / scale:.1f} {unit}"
    return f"{value:.0f} B"


def data_curves(
    evaluations: Sequence[dict], points: Sequence[dict], summaries: Sequence[dict], plan: dict | None = None
) -> list[dict]:
    """Per partition (and `all`, the mix) with more than one draft size: the curve of its drafts
    (acceptance.json and `points`, the curve/*.json), the baseline's beside it, the price of 2x and 4x the
    data (the plan's per prompt where results/plan.json counted the partitions, else the run's own) and
    the line that says it (reporting/curve.py)."""
    by_name: dict[str, list[dict]] = {}
    for figures in [*evaluations, *points]:
        by_name.setdefault(figures["partition"], []).append(figures)
    plan_rows = {r["partition"]: r for r in (plan or {}).get("partitions", [])}
    named = {s["partition"]: s for s in summaries}
    out = []
    for name, drafts in by_name.items():
        if len(drafts) < 2:  # the whole's draft alone: no curve
            continue
        settings = drafts[0]["settings"]
        ceiling = settings["speculative"]["num_steps"] + 1
        points = curve.points_of(drafts)
        fit = curve.fit_curve(points, seed=settings["seed"], ceiling=ceiling)
        if fit is None:
            continue
        baseline = difference = None
        if all(d.get("baseline") for d in drafts):
            original = curve.points_of(drafts, baseline=True)
            baseline = curve.fit_curve(original, seed=settings["seed"], ceiling=ceiling)
            difference = curve.slope_difference(points, original, seed=settings["seed"])
        parts = [named[p] for p in named if name in ("all", p)]
        per_sample = curve.per_sample_price(
            [plan_rows[p["partition"]] for p in parts if p["partition"] in plan_rows], parts
        )
        top = fit["points"][-1]["samples"]
        prices = [curve.data_price(top, k, per_sample) for k in curve.FACTORS]
        out.append(
            {
                "partition": name,
                "curve": fit,
                "baseline": baseline,
                # the regenerated curve's gain per doubling minus the baseline's (paired bootstrap)
                "baseline_difference": difference,
                "prices": prices,
                "price_basis": per_sample["basis"],
                "line": curve.curve_line(name, fit, prices, baseline, difference),
                "brief": curve.verdict_words(fit, prices),
                "baseline_brief": curve.baseline_words(baseline, difference) if baseline else None,
            }
        )
    return out


def curve_section(curves: list[dict]) -> dict | None:
    if not curves:
        return None
    rows = [
        [
            c["partition"],
            ", ".join(f"{p['samples']}: {p['acceptance_length']:.3f}" for p in c["curve"]["points"]),
            f"{c['curve']['gain_per_doubling']:+.3f} {_interval(c['curve']['gain_per_doubling_interval_95'])}",
            *(
                f"{a['acceptance_length']:.3f} {_interval(a['interval_95'])} for {curve.price_words(p)}"
                for a, p in zip(c["curve"]["extrapolated"], c["prices"], strict=True)
            ),
            ", ".join(f"{p['samples']}: {p['acceptance_length']:.3f}" for p in b["points"])
            + f"; {b['gain_per_doubling']:+.3f} {_interval(b['gain_per_doubling_interval_95'])}"
            if (b := c["baseline"])
            else "-",
        ]
        for c in curves
    ]
    return {
        "rows": rows,
        "method": curve.METHOD,
        "price_basis": sorted({c["price_basis"] for c in curves}),
        "figure": report_plots.curve_figure(curves),
    }


def shared_rows(shared: dict | None) -> list[list]:
    """The shared-prompt table's rows: each pair of partitions, then each partition against all others."""
    if not shared or not shared["pairs"]:
        return []
    return [[pair, n] for pair, n in shared["pairs"].items()] + [
        [f"{name}: in another partition", n] for name, n in shared["per_partition"].items()
    ]


def gates_section(summaries: list[dict]) -> dict | None:
    """The quality gates' table: per partition, rows in, rows dropped, and each reason's count and rate
    (`off` for a gate the run turned off)."""
    gated = [s for s in summaries if s.get("gates")]
    if not any(s["gates"]["rows"] for s in gated):
        return None
    reasons = [*GATES, *UNUSABLE]

    def cell(gates: dict, reason: str) -> str:
        if reason in gates["off"]:
            return "off"
        return f"{gates['counts'].get(reason, 0)} ({gates['rates'].get(reason, 0.0):.1%})"

    rows = [
        [
            s["partition"],
            s["gates"]["rows"],
            f"{s['gates']['dropped_rows']} ({s['gates']['dropped_rows'] / s['gates']['rows']:.1%})"
            if s["gates"]["rows"]
            else "0",
            *(cell(s["gates"], reason) for reason in reasons),
        ]
        for s in gated
    ]
    return {"header": ["partition", "response rows", "dropped", *reasons], "rows": rows}


def probe_section(summaries: list[dict]) -> dict | None:
    probed = [s for s in summaries if s.get("probe")]
    if not probed:
        return None
    rows = [
        [
            s["partition"],
            ", ".join(s["probe"]["backend"]),
            s["probe"]["greedy_exact"],
            *(
                f"{s['probe'][scope].get('top1_agreement', float('nan')):.4f}"
                for scope in ("last_turn", "last_turn_first_positions", "earlier_turns")
            ),
            f"{s['probe']['all'].get('mean_logprob', float('nan')):.3f}",
            f"{s['probe']['all'].get('outside_top5', float('nan')):.4f}",
            s["probe"]["verdicts"],
        ]
        for s in probed
    ]
    return {"rows": rows, "figure": report_plots.agreement_by_position(probed)}


def evaluation_figures(acceptance: dict) -> dict:
    """What the report shows of one acceptance.json (stages/evaluate/measure.py): the measured acceptance
    length and its interval, by draft position, the trainer's estimate, and the draft trained on the
    dataset's original responses where the run had that baseline (`baseline`: None without one)."""
    baseline = acceptance.get("baseline")
    return {
        **{
            key: acceptance[key]
            for key in (
                "partition",
                "acceptance_length",
                "interval_95",
                "acceptance_by_position",
                "prompts",
                "verify_steps",
                "measured_by",
            )
        },
        "trainer_estimate": acceptance["trainer_estimate"]["acceptance_length"],
        "baseline": {k: baseline[k] for k in ("acceptance_length", "difference", "difference_interval_95")}
        if baseline
        else None,
    }


def evaluation_section(evaluations: list[dict]) -> dict | None:
    if not evaluations:
        return None
    rows = [
        [
            e["partition"],
            f"{e['acceptance_length']:.3f}",
            _interval(e["interval_95"]),
            f"{e['trainer_estimate']:.3f}",
            e["prompts"],
            e["verify_steps"],
            *(
                [f"{b['acceptance_length']:.3f}", f"{b['difference']:.3f}", _interval(b["difference_interval_95"])]
                if (b := e["baseline"])
                else ["-", "-", "-"]
            ),
        ]
        for e in evaluations
    ]
    measured_by = sorted({e["measured_by"] for e in evaluations})
    return {"rows": rows, "measured_by": measured_by, "figure": report_plots.evaluation_figure(evaluations)}


def _interval(bounds: list[float]) -> str:
    return f"[{bounds[0]:.3f}, {bounds[1]:.3f}]"


def write_partition_summary(out: str, **kwargs) -> dict:
    summary = partition_summary(**kwargs)
    write_json(out, summary)
    return summary
