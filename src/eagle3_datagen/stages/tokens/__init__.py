"""Stage 3: responses -> input_ids + loss mask, rebuilt with the model's own chat template.

Each regenerated turn is trained as the model emitted it: its generation prompt (the history
rendered with `add_generation_prompt`, tools declared) followed by exactly what the model
produced after it. With the server's generated IDs that is those IDs; from text it is the turn
rebuilt in the model's format, derived from the template (Kimi-K2.5's prompt opens `<think>`, so
`{reasoning}</think>{content}<|im_end|>`; Qwen3's does not, so `<think>\n{reasoning}\n</think>...`).
Where both exist they are audited against each other, continuation against continuation. Rows
that a quality gate fails (`chat/gates.py`: truncated, empty, filtered, refused, looping, reasoning
leaked, missing or left in the content, tool calls that do not parse or are written as text) are not
trained, and are listed with their reasons; a gate that drops more than its share of a shard's rows
(`tokens.gates.max_shard_rates`) fails the shard's job.

`turns` locates the trained turns in the template's rendering, `encoding` turns that text into
IDs (prompts encoded whole, boundaries through the tokenizer's offsets), `audit` compares and
counts; `TokenBuilder` assembles samples and `run_tokens` is the stage's job.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from transformers import PreTrainedTokenizerBase

from eagle3_datagen.chat.families.target_chat import Family, load_chat
from eagle3_datagen.chat.gates import GateMarkers, Gates, GateSettings, console_line, over_limits, pooled
from eagle3_datagen.chat.template import SpecialTokens, tools_rendering
from eagle3_datagen.chat.tiktoken_fast import fast_tokenizer_from_tiktoken
from eagle3_datagen.formats.files import read_json, read_jsonl, write_json, write_jsonl_zst
from eagle3_datagen.formats.histograms import histogram
from eagle3_datagen.progress import Progress
from eagle3_datagen.stages.tokens.audit import Audit, AuditFailure
from eagle3_datagen.stages.tokens.encoding import PlanEncoder
from eagle3_datagen.stages.tokens.turns import TurnLocator, TurnPlan

log = logging.getLogger(__name__)


@dataclass
class TokenSettings:
    """The `tokens` settings (config.schema.yaml says each one's meaning and default)."""

    thinking: str
    prefer_ids: str  # "server" | "text"
    gates: GateSettings
    loss_turns: str  # "all" | "last"
    max_length: int
    length_policy: str  # "truncate" | "drop"
    max_semantic_mismatch_rate: float
    audit_examples: int

    @classmethod
    def from_config(cls, section: dict) -> TokenSettings:
        """From the validated config's `tokens` section, where validation filled every default."""
        settings = {name: section[name] for name in cls.__dataclass_fields__}
        return cls(**{**settings, "gates": GateSettings.from_config(section["gates"])})


class TokenBuilder:
    """Response rows -> training samples, a batch of rows at a time.

    A sample is the trained turn's generation prompt followed by what the model produced after
    it: the server's IDs when it returned them, else the turn rebuilt from text in the model's
    own format. Where the turns lie is `turns.TurnLocator`'s (rendering with `tokenizer`, its own
    `apply_chat_template`, tools included); their IDs are `encoding.PlanEncoder`'s (`encoder`, by
    default the same tokenizer, checked against `reference` when given); this class applies the
    quality gates (with the markers of `tokenizer` and its template), assembles IDs and loss mask,
    audits rebuilt IDs against the server's, and applies the length policy.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        specials: SpecialTokens,
        settings: TokenSettings,
        template_kwargs: dict | None = None,
        boundaries: str = "auto",
        encoder: PreTrainedTokenizerBase | None = None,
        reference: PreTrainedTokenizerBase | None = None,
        family: Family | None = None,
    ):
        self.locator = TurnLocator(
            tokenizer,
            specials,
            settings.thinking,
            settings.loss_turns,
            template_kwargs,
            family,
        )
        self.gates = Gates(settings.gates, GateMarkers.of(tokenizer, specials, template_kwargs))
        self.encoding = PlanEncoder(encoder or tokenizer, reference, boundaries)
        self.tokenizer = tokenizer
        self.specials = specials
        self.settings = settings
        self.audit = Audit()
        self.tools_rendering = tools_rendering(tokenizer, template_kwargs or {})

    def samples_for(self, row: dict) -> list[dict]:
        """The training samples of one response row (none when the row is dropped)."""
        return self.samples_for_rows([row])

    def samples_for_rows(self, rows: list[dict]) -> list[dict]:
        """The training samples of `rows` that the gates pass, in order, encoded in one batch."""
        self.audit.counts["rows_in"] += len(rows)
        passed = self.audit.gated.check(self.gates, rows)
        plans = [plan for row in passed for plan in self.locator.plans(row, self.audit.counts)]
        if not plans:
            return []
        encoded = self.encoding.encode(plans, self.audit.counts)
        samples = [self._sample(plan, *ids) for plan, *ids in zip(plans, *encoded, strict=True)]
        return [s for s in samples if s is not None]

    def _sample(
        self, plan: TurnPlan, prompt_ids: list[int], spans: list[tuple[int, int]], rebuilt: list[int]
    ) -> dict | None:
        counts = self.audit.counts
        output = rebuilt
        ids_from = "text"
        if plan.server_ids is not None:
            self.audit.compare(
                plan.sample_id, rebuilt, plan.server_ids, self.encoding.encoder, self.settings.audit_examples
            )
            # The prompt the server counted and the one rendered here should be the same IDs
            # (a difference: tools or template settings not as in generation).
            if plan.server_prompt_tokens not in (None, len(prompt_ids)):
                counts["server_prompt_length_differs"] += 1
            if self.settings.prefer_ids == "server":
                output = list(plan.server_ids)
                ids_from = "server"
        input_ids = prompt_ids + output
        loss_mask = [0] * len(input_ids)
        for start, end in [*spans, (len(prompt_ids), len(input_ids))]:
            loss_mask[start:end] = [1] * (end - start)
        if len(input_ids) > self.settings.max_length:
            if self.settings.length_policy == "drop":
                counts["dropped_too_long"] += 1
                return None
            counts["truncated_to_max_length"] += 1
            input_ids = input_ids[: self.settings.max_length]
            loss_mask = loss_mask[: self.settings.max_length]
            if not any(loss_mask):
                counts["dropped_no_loss_after_truncation"] += 1
                return None
        counts["samples_out"] += 1
        counts["tokens"] += len(input_ids)
        counts["loss_tokens"] += sum(loss_mask)
        counts[f"ids_from_{ids_from}"] += 1
        return {"id": plan.sample_id, "input_ids": input_ids, "loss_mask": loss_mask}

    def report(self) -> dict:
        return {
            "settings": dataclasses.asdict(self.settings),
            "tokenizer": self.describe_tokenizer(),
            "family": self.locator.family.name,
            "boundaries": self.encoding.boundaries,
            "tools_rendering": self.tools_rendering,
            "special_tokens": self.specials.as_dict(),
            "counts": dict(sorted(self.audit.counts.items())),
            "gates": {
                **self.audit.gated.report(self.settings.gates),
                "markers": dataclasses.asdict(self.gates.markers),
            },
            "audit": self.audit.summary(),
        }

    def describe_tokenizer(self) -> dict:
        """Which tokenizer rendered and which encoded, and whether the encoder was checked."""
        return {
            "model": f"{type(self.tokenizer).__name__} ({'fast' if self.tokenizer.is_fast else 'slow'})",
            "encoder": "model"
            if self.encoding.encoder is self.tokenizer
            else f"{type(self.encoding.encoder).__name__} (fast)",
            "checked_against_model": self.encoding.reference is not None,
        }


def loss_spans(input_ids: list[int], loss_mask: list[int]) -> list[list[int]]:
    """The token IDs of each contiguous run of loss-mask 1s, in order."""
    spans: list[list[int]] = []
    previous = 0
    for token, bit in zip(input_ids, loss_mask, strict=True):
        if bit:
            if not previous:
                spans.append([])
            spans[-1].append(token)
        previous = bit
    return spans


# Rows per encoding batch, and per task when several processes share a shard.
CHUNK_ROWS = 256
_worker_builder: TokenBuilder | None = None


def make_builder(model_path: str | Path, model_settings: dict, settings: TokenSettings) -> TokenBuilder:
    """The builder for a model directory. A slow tokenizer beside a `tiktoken.model` (Kimi's
    remote-code `TikTokenTokenizer`) keeps rendering, and a fast tokenizer built from the same
    files encodes, checked against the model's own on every text."""
    chat = load_chat(model_path, model_settings)
    tokenizer = chat.tokenizer
    encoder = reference = None
    if not tokenizer.is_fast and (Path(model_path) / "tiktoken.model").exists():
        encoder, reference = fast_tokenizer_from_tiktoken(model_path), tokenizer
    return TokenBuilder(
        tokenizer,
        chat.specials,
        settings,
        chat.template_kwargs,
        encoder=encoder,
        reference=reference,
        family=chat.family,
    )


def _one_core() -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"


def _build_chunk(rows: list[dict]) -> tuple[list[dict], Audit]:
    """Runs in a forked worker, on the builder the parent made before forking."""
    _worker_builder.audit = Audit()
    return _worker_builder.samples_for_rows(rows), _worker_builder.audit


def build_samples(
    rows: list[dict],
    model_path: str | Path,
    model_settings: dict,
    settings: TokenSettings,
    workers: int = 1,
) -> tuple[list[dict], dict]:
    """All samples of `rows` in order, and the audit report; `workers` processes share the chunks.

    The chat template is rendered in Python, one core per process: more processes, not threads,
    are what scale it.
    """
    builder = make_builder(model_path, model_settings, settings)
    log.info("special tokens: %s", builder.specials.as_dict())
    chunks = [rows[i : i + CHUNK_ROWS] for i in range(0, len(rows), CHUNK_ROWS)]
    samples: list[dict] = []
    progress = Progress(len(rows), "rows", log)
    if workers > 1 and len(chunks) > 1:
        global _worker_builder
        _worker_builder = builder
        # Forked workers inherit the loaded tokenizer; each encodes on one core.
        context = multiprocessing.get_context("fork")
        with ProcessPoolExecutor(workers, mp_context=context, initializer=_one_core) as pool:
            for chunk, (chunk_samples, audit) in zip(chunks, pool.map(_build_chunk, chunks), strict=True):
                samples.extend(chunk_samples)
                builder.audit.merge(audit, settings.audit_examples)
                progress.advance(len(chunk), tokens=sum(len(s["input_ids"]) for s in chunk_samples))
    else:
        for chunk in chunks:
            chunk_samples = builder.samples_for_rows(chunk)
            samples.extend(chunk_samples)
            progress.advance(len(chunk), tokens=sum(len(s["input_ids"]) for s in chunk_samples))
    progress.close()
    return samples, builder.report()


class NothingTrained(RuntimeError):
    """A shard with response rows of which none is trained: its failures and gates say why."""


class GateRateExceeded(RuntimeError):
    """A gate dropped more of a shard's rows than `tokens.gates.max_shard_rates` allows."""


def run_tokens(
    responses_path: str | Path,
    out_path: str | Path,
    audit_path: str | Path,
    model_path: str | Path,
    model_settings: dict,
    settings: TokenSettings,
    workers: int = 1,
) -> dict:
    samples, report = build_samples(read_jsonl(responses_path), model_path, model_settings, settings, workers)
    gates = report["gates"]
    log.info("%s", console_line(str(responses_path), gates))
    rate = report["audit"]["semantic_rate"]
    if rate > settings.max_semantic_mismatch_rate:
        log.error("audit: %s", report["audit"])
        raise AuditFailure(
            f"{responses_path}: {report['audit']['semantic']} of {report['audit']['turns_compared']} turns "
            f"({rate:.2%}) rebuilt from text differ in meaning from the server's token IDs, above "
            f"tokens.max_semantic_mismatch_rate={settings.max_semantic_mismatch_rate}. The chat template or "
            "the response parsing does not match what the model generated; see the examples in the log"
        )
    if gates["rows"] and not samples:
        # An empty shard would flow through hidden states, probe and exports as if all were well.
        log.info("dropped rows: %s", json.dumps(gates["dropped"]))
        why = ", ".join(f"{reason} {n}" for reason, n in gates["counts"].items() if n) or "none dropped by a gate"
        raise NothingTrained(
            f"{responses_path}: none of its {gates['rows']} response rows is trained ({why}; token counts: "
            f"{json.dumps({k: v for k, v in report['counts'].items() if k.startswith('dropped_')})}). Fix the "
            "responses (rerun them, raise inference.sampling.max_new_tokens) or turn the gate off under "
            "tokens.gates; each row's reasons are in this job's log"
        )
    over = over_limits(gates, settings.gates)
    if over:
        log.info("dropped rows: %s", json.dumps(gates["dropped"]))
        path = Path(responses_path)
        where = f"partition {path.parent.parent.name}, shard {path.name.split('.')[0]}"
        why = "; ".join(
            f"{gate} dropped {n} of {gates['rows']} rows ({rate:.1%}), above tokens.gates.max_shard_rates.{gate}: "
            f"{limit}"
            for gate, n, rate, limit in over
        )
        raise GateRateExceeded(
            f"{responses_path} ({where}): {why}. Look at the dropped rows (their ids and reasons are in this "
            "job's log): fix the responses (the provider, the template settings, the sampling) and rerun them, "
            "or raise the share under tokens.gates.max_shard_rates (or turn the gate off under tokens.gates)"
        )
    report["lengths"] = {
        "sample_tokens": histogram(len(s["input_ids"]) for s in samples),
        "loss_tokens": histogram(sum(s["loss_mask"]) for s in samples),
    }
    write_jsonl_zst(out_path, samples)
    write_json(audit_path, report)
    return report


def finished_gates(tokens_dir: str | Path) -> dict:
    """The gates of a partition's tokens shards finished so far (their audits in `tokens_dir`), pooled,
    with how many shards that is (`shards`)."""
    reports = [read_json(p).get("gates") for p in sorted(Path(tokens_dir).glob("*.audit.json"))]
    reports = [r for r in reports if r]
    return {**pooled(reports), "shards": len(reports)}
