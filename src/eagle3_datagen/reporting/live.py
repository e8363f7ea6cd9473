"""What a run has done so far, per partition, read from its files while it goes.

Per responses shard: a finished one from its stats (`{shard}.stats.json`), a running or stopped one
from its journal (`.{shard}.jsonl.zst.journal.jsonl`, read as its job appends: `formats/journal.py`).
Prompts answered, failed (per reason: `context_overflow`, `moderation`, ..., `retries_exhausted`) and
truncated come from the rows' status, tokens (prompt + completion) and dollars from each assistant
turn's `usage` and what failed requests were billed (`lost`).
Gated rows are the tokens audit's (`{shard}.audit.json`,
exact) where the tokens stage has run; elsewhere, given `gates`, the quality gates are applied to the
rows as the tokens stage will (`chat/gates.py`). The rate of a started shard is its rows over the time
since its journal was begun (a journal resumed after a stop counts the pause, and a stopped one's rate
falls); `rates` gives the rate between two reads instead.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from eagle3_datagen.chat.gates import Gates
from eagle3_datagen.formats.files import read_json, read_jsonl
from eagle3_datagen.formats.journal import journal_path, read_journal, row_spend
from eagle3_datagen.formats.spend import Spend

COUNTS = ("prompts", "answered", "failed", "truncated", "gated", "tokens")


@dataclass
class Progress:
    """One partition's responses so far (or one shard's)."""

    shards: Counter = field(default_factory=Counter)  # done, started (a journal), pending
    prompts: int = 0  # in its prompt shards, where known
    answered: int = 0  # rows with an answer (any status but failed)
    failed: int = 0
    truncated: int = 0
    gated: int = 0  # answered rows the gates drop (malformed ones included)
    gate_counts: Counter = field(default_factory=Counter)
    failure_counts: Counter = field(default_factory=Counter)  # failed prompts per reason
    tokens: int = 0
    cost: float = 0.0
    rows_per_s: float = 0.0  # the started shards' rates, summed
    gated_live: int = 0  # shards whose gated rows were counted here, not by the tokens stage

    def add(self, other: Progress) -> None:
        for name in (*COUNTS, "cost", "rows_per_s", "gated_live"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.shards.update(other.shards)
        self.gate_counts.update(other.gate_counts)
        self.failure_counts.update(other.failure_counts)

    def as_dict(self) -> dict:
        return {
            **{name: getattr(self, name) for name in COUNTS},
            "shards": dict(self.shards),
            "gate_counts": dict(self.gate_counts),
            "failure_counts": dict(self.failure_counts),
            "cost_usd": round(self.cost, 6),
            "rows_per_s": self.rows_per_s,
            "gated_live": self.gated_live,
        }


def _gated(progress: Progress, audit: Path, rows: list[dict] | None, gates: Gates | None) -> None:
    """The gated rows: the tokens audit's where it exists, else `gates` on `rows` (when both are given)."""
    report = read_json(audit).get("gates") if audit.exists() else None
    if report is not None:
        dropped = [reasons for reasons in report["dropped"].values() if reasons != ["failed"]]
    elif gates is not None and rows is not None:
        dropped = [r for r in map(gates.reasons, rows) if r and r != ["failed"]]
        progress.gated_live += 1
    else:
        return
    progress.gated += len(dropped)
    for reasons in dropped:
        progress.gate_counts.update(reasons)


def shard_progress(results: Path, partition: str, shard: str, gates: Gates | None, now: float) -> Progress:
    responses = results / partition / "responses"
    stats_path, out = responses / f"{shard}.stats.json", responses / f"{shard}.jsonl.zst"
    journal = journal_path(out)
    audit = results / partition / "tokens" / f"{shard}.audit.json"
    progress = Progress()
    if stats_path.exists():
        stats = read_json(stats_path)
        status = Counter(stats["status"])
        progress.shards["done"] += 1
        progress.failed, progress.truncated = status["failed"], status["truncated"]
        progress.answered = sum(status.values()) - status["failed"]
        # stats written before failures had reasons: one count, "failed"
        progress.failure_counts.update(stats.get("failures") or {"failed": status["failed"]})
        progress.failure_counts = +progress.failure_counts
        usage = stats["usage"]
        progress.tokens = sum(usage.get(k, 0) for k in ("prompt_tokens", "completion_tokens", "lost_tokens"))
        progress.cost = usage.get("cost", 0.0) + usage.get("lost_cost", 0.0)
        rows = read_jsonl(out) if gates is not None and not audit.exists() and out.exists() else None
        _gated(progress, audit, rows, gates)
    elif journal.exists():
        header, by_id = read_journal(journal)
        rows = list(by_id.values())
        progress.shards["started"] += 1
        status = Counter(r["status"] for r in rows)
        progress.failed, progress.truncated = status["failed"], status["truncated"]
        progress.answered = len(rows) - status["failed"]
        progress.failure_counts.update(r.get("failure") or "failed" for r in rows if r["status"] == "failed")
        spent = sum((row_spend(row) for row in rows), Spend())
        progress.cost, progress.tokens = spent.cost, spent.tokens
        if header.get("started") and rows:
            progress.rows_per_s = len(rows) / max(now - header["started"], 1e-3)
        _gated(progress, audit, rows, gates)
    else:
        progress.shards["pending"] += 1
    return progress


def run_progress(
    workdir: str | Path, shards: dict[str, list[str]], gates: Gates | None = None, now: float | None = None
) -> dict[str, Progress]:
    """Per partition (`shards`: its shard names), its responses so far."""
    results = Path(workdir) / "results"
    now = time.time() if now is None else now
    out = {}
    for partition, names in shards.items():
        total = Progress()
        for shard in names:
            total.add(shard_progress(results, partition, shard, gates, now))
        prompt_stats = results / partition / "prompts" / "stats.json"
        total.prompts = read_json(prompt_stats)["prompts"] if prompt_stats.exists() else 0
        out[partition] = total
    return out


def rates(before: dict[str, Progress], after: dict[str, Progress], seconds: float) -> dict[str, Progress]:
    """`after` with each partition's rate the rows journalled or finished between two reads `seconds` apart."""
    for name, progress in after.items():
        done = progress.answered + progress.failed
        previous = before.get(name)
        earlier = previous.answered + previous.failed if previous else done
        progress.rows_per_s = max(done - earlier, 0) / seconds if seconds > 0 else 0.0
    return after


def format_progress(progress: dict[str, Progress]) -> str:
    header = (
        f"{'partition':<24} {'shards d/s/p':>13} {'answered':>14} {'failed':>7} {'truncated':>9} {'gated':>7} "
        f"{'tokens':>12} {'dollars':>10} {'rows/min':>9}"
    )
    lines = [header]
    for name, p in progress.items():
        shards = f"{p.shards['done']}/{p.shards['started']}/{p.shards['pending']}"
        answered = f"{p.answered}/{p.prompts}" if p.prompts else str(p.answered)
        lines.append(
            f"{name:<24} {shards:>13} {answered:>14} {p.failed:>7} {p.truncated:>9} {p.gated:>7} "
            f"{p.tokens:>12,} {p.cost:>10.4f} {p.rows_per_s * 60:>9.1f}"
        )
        if p.failure_counts:
            lines.append(f"    failed: {', '.join(f'{reason} {n}' for reason, n in p.failure_counts.most_common())}")
        if p.gate_counts:
            live = f" ({p.gated_live} shards gated here, the others by the tokens stage)" if p.gated_live else ""
            reasons = ", ".join(f"{reason} {n}" for reason, n in p.gate_counts.most_common())
            lines.append(f"    gated: {reasons}{live}")
    return "\n".join(lines)


def model_gates(config: dict) -> tuple[Gates | None, str | None]:
    """The run's gates with the markers of its model's tokenizer (`config`: validated, defaults filled), or
    None and why not (a model directory not there yet: the demo's is built by the run)."""
    from eagle3_datagen.chat.gates import GateMarkers, GateSettings
    from eagle3_datagen.chat.template import load_tokenizer, resolve_special_tokens

    model = config["model"]
    try:
        tokenizer = load_tokenizer(model["path"], model["trust_remote_code"])
        kwargs = model["chat_template_kwargs"]
        specials = resolve_special_tokens(tokenizer, model["special_tokens"], kwargs)
    except (OSError, ValueError) as e:
        return None, f"{model['path']}: {str(e).splitlines()[0]}"
    return Gates(GateSettings.from_config(config["tokens"]["gates"]), GateMarkers.of(tokenizer, specials, kwargs)), None
