"""One partition's evaluation: a draft trained on its SpecForge export, its acceptance length measured by
speculative decoding of the target on held-out prompts, SpecForge's own estimate beside it."""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Iterable
from pathlib import Path
from typing import TextIO

import torch
from transformers import AutoModelForCausalLM

from eagle3_datagen.formats.files import InputError, read_jsonl
from eagle3_datagen.stages.evaluate.draft import (
    load_draft,
    specforge_on_cpu,
    train_config,
    train_draft,
    trainer_estimate,
    training_forward,
)
from eagle3_datagen.stages.evaluate.speculative import acceptance_length, speculative_decode, target_pass

MEASURED_BY = "greedy chain speculative decoding in transformers on the CPU (top-k 1), not SGLang"
ESTIMATED_BY = "SpecForge 0.2.0's simulated_acc_len + 1 over its training-time forward on the held-out outputs"


def held_out_prompt(sample: dict) -> list[int]:
    """The tokens before the sample's last loss-masked run (its last assistant turn): what the target answers."""
    mask = sample["loss_mask"]
    end = len(mask)
    while end and not mask[end - 1]:
        end -= 1
    start = end
    while start and mask[start - 1]:
        start -= 1
    if start == 0:
        raise ValueError(f"sample {sample.get('id')}: no prompt before its last loss-masked tokens")
    return list(sample["input_ids"][:start])


def bootstrap_interval(
    committed: list[int], steps: list[int], reps: int = 2000, seed: int = 0, level: float = 0.95
) -> list[float]:
    """Percentile bootstrap over prompts of summed committed tokens / summed verify steps."""
    rng = random.Random(seed)
    n = len(committed)
    values = []
    for _ in range(reps):
        picks = [rng.randrange(n) for _ in range(n)]
        values.append(sum(committed[i] for i in picks) / sum(steps[i] for i in picks))
    values.sort()
    tail = (1 - level) / 2
    return [values[int(tail * (reps - 1))], values[int((1 - tail) * (reps - 1))]]


def held_out_samples(token_rows: Iterable[dict], ids: Iterable[str]) -> list[dict]:
    """The token rows of the held-out prompt ids, in the rows' order (a held-out prompt without a sample,
    its response dropped by the tokens stage, is absent)."""
    wanted = set(ids)
    return [row for row in token_rows if row["id"] in wanted]


def _sample_files(export: Path) -> dict[int, Path]:
    """{index in ids.jsonl: the sample's file} of a SpecForge export (`rows_*/data_<index>.ckpt[.gz]`)."""
    files = (p for p in export.glob("rows_*/data_*") if p.name.endswith((".ckpt", ".ckpt.gz")))
    return {int(p.name.removeprefix("data_").split(".")[0]): p for p in files}


def nested_subset(ids: list[str], fraction: float, seed: int, least: int) -> set[str]:
    """The first round(`fraction` * len(ids)) of `ids` (at least `least`, at most all) in the order of
    sha256(`seed:id`): a smaller fraction's subset lies inside every larger one's, and a partition and its
    baseline twin (the same prompt ids) keep the same prompts."""
    count = min(len(ids), max(least, round(fraction * len(ids))))
    return set(sorted(ids, key=lambda i: hashlib.sha256(f"{seed}:{i}".encode()).hexdigest())[:count])


def training_data(
    exports: list[Path], work_dir: Path, fraction: float = 1.0, seed: int = 0, least: int = 1
) -> Path | None:
    """Where SpecForge reads the training samples: the one export itself, or for several exports (all
    partitions together) or a `fraction` of the samples (`nested_subset` of every export's sample ids
    together, at least `least`) a directory of links to the samples, one folder per export (its reader
    lists every `.ckpt` and `.ckpt.gz` below the directory, sorted). The exports must share one draft config."""
    if len(exports) == 1 and fraction >= 1:
        return None
    configs = {(e / "draft_config.json").read_text() for e in exports}
    if len(configs) > 1:
        named = [str(e) for e in exports]
        raise ValueError(f"exports {named} have different draft configs: one draft cannot train on all of them")
    ids = {(n, row["index"]): row["id"] for n, e in enumerate(exports) for row in read_jsonl(e / "ids.jsonl")}
    kept = nested_subset(list(ids.values()), fraction, seed, least) if fraction < 1 else set(ids.values())
    data = work_dir / "data"
    for number, export in enumerate(exports):
        for index, sample in sorted(_sample_files(export).items()):
            if ids[number, index] not in kept:
                continue
            link = data / f"{number:05d}" / sample.relative_to(export)
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(sample.resolve())
    return data


def trained_samples(data: Path | None, exports: list[Path]) -> int:
    """The samples a draft trains on: those under `data`, or (None) every export's."""
    if data is None:
        return sum(json.loads((e / "export.json").read_text())["samples"] for e in exports)
    return sum(1 for p in data.rglob("data_*") if p.name.endswith((".ckpt", ".ckpt.gz")))


def evaluate_partition(
    exports: list[Path],
    held_out: list[dict],
    work_dir: Path,
    settings: dict,
    log: TextIO,
    vocab_dir: Path | None = None,
    fraction: float = 1.0,
) -> tuple[dict, Path]:
    """Train on `exports` (SpecForge's; `settings`: the `evaluate` section), or on a nested `fraction` of
    their samples (`training_data`), with the draft vocabulary under `vocab_dir` (None: the one the first
    export names), decode each held-out prompt
    (`speculative.num_steps` proposals a step, up to `max_new_tokens`) and estimate; returns the figures
    and the trained draft's checkpoint directory (`log`: where SpecForge's output goes)."""
    if not held_out:
        raise ValueError("no held-out sample to decode: raise evaluate.holdout (or the partition has no samples)")
    data = training_data(exports, work_dir, fraction, settings["seed"], settings["batch_size"])
    samples = trained_samples(data, exports)
    if samples < settings["batch_size"]:
        # SpecForge's loader drops an incomplete batch: fewer samples than a batch train nothing
        raise InputError(
            exports[0] / "export.json",
            None,
            f"{samples} training samples, fewer than one batch (evaluate.batch_size {settings['batch_size']})",
            "lower evaluate.batch_size or evaluate.holdout, or give the partition more prompts",
        )
    torch.manual_seed(settings["seed"])
    specforge_on_cpu()
    torch.set_num_threads(1)  # the tiny CPU models' matrices: one thread beats two contending
    export_dir = exports[0]
    run = train_draft(export_dir, work_dir, settings, log, data, vocab_dir)
    draft = load_draft(run, export_dir, vocab_dir)
    aux_layers = json.loads((export_dir / "export.json").read_text())["aux_layers"]
    target_path = train_config(export_dir)["model"]["target_model_path"]
    target = AutoModelForCausalLM.from_pretrained(target_path, dtype=torch.float32).eval()
    eos = target.generation_config.eos_token_id
    stop_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    steps, ttt_length = settings["speculative"]["num_steps"], settings["ttt_length"]
    decoded, corrects, denoms = [], [0.0] * ttt_length, [0.0] * ttt_length
    for sample in held_out:
        prompt = held_out_prompt(sample)
        d = speculative_decode(target, draft, prompt, aux_layers, steps, settings["max_new_tokens"], stop_ids)
        decoded.append(d)
        sequence = prompt + d.tokens
        aux, _ = target_pass(target, sequence, aux_layers)
        with torch.no_grad():
            logits = target(torch.tensor([sequence])).logits[0]
        mask = [0] * len(prompt) + [1] * len(d.tokens)
        forward = training_forward(draft, aux, sequence, logits, mask, ttt_length)
        corrects = [a + b for a, b in zip(corrects, forward["corrects"], strict=True)]
        denoms = [a + b for a, b in zip(denoms, forward["denoms"], strict=True)]
    accepted = [a for d in decoded for a in d.accepted]
    estimate = trainer_estimate(corrects, denoms, steps)
    at_steps = estimate["simulated_acc_len_plus_1_at_steps"]  # the figure comparable to the measurement
    figures = {
        "acceptance_length": acceptance_length(decoded),
        "interval_95": bootstrap_interval(
            [d.committed for d in decoded if d.accepted], [len(d.accepted) for d in decoded if d.accepted]
        ),
        "measured_by": MEASURED_BY,
        "prompts": len(decoded),
        "samples": samples,
        "fraction": fraction,
        "verify_steps": len(accepted),
        "committed_tokens": sum(d.committed for d in decoded),
        # how often the k-th proposal was accepted, k = 1..steps
        "acceptance_by_position": [sum(a >= k for a in accepted) / len(accepted) for k in range(1, steps + 1)],
        "per_prompt": [
            {"id": s.get("id"), "acceptance_length": d.acceptance_length, "accepted": d.accepted}
            for s, d in zip(held_out, decoded, strict=True)
        ],
        "trainer_estimate": {"estimated_by": ESTIMATED_BY, **estimate, "acceptance_length": at_steps},
        "settings": settings,
    }
    return figures, run
