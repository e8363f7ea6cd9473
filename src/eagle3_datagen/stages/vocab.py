"""The draft model's vocabulary: token frequencies under the loss mask, and `d2t` / `t2d`.

The draft predicts over the `draft_vocab_size` target tokens it is trained to predict most
often. `t2d[t]` says whether target token t is in the draft vocabulary; `d2t[d]` is the
offset from draft id d to its target id (target = d + d2t[d]), draft ids in target-id order:
the layout SpecForge and vLLM speculators read.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from pathlib import Path

import numpy as np

from eagle3_datagen.formats.checkpoint import text_config
from eagle3_datagen.formats.draft_vocab import write_mapping
from eagle3_datagen.formats.files import atomic_dir, iter_jsonl, write_json


def target_vocab_size(model_path: str | Path) -> int:
    return int(text_config(model_path)["vocab_size"])


def loss_token_counts(
    tokens_paths: Iterable[str | Path], vocab_size: int, held_out: Collection[str] = ()
) -> np.ndarray:
    """How often each target token is a loss-masked (trained) token, the evaluation's held-out samples
    (`held_out`: their ids) left out as they are of the exports."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    held_out = set(held_out)
    for path in tokens_paths:
        for _, sample in iter_jsonl(path):
            if sample["id"] in held_out:
                continue
            ids = np.asarray(sample["input_ids"], dtype=np.int64)
            trained = ids[np.asarray(sample["loss_mask"], dtype=bool)]
            counts += np.bincount(trained, minlength=vocab_size)[:vocab_size]
    return counts


def vocab_mapping(counts: np.ndarray, draft_vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(d2t, t2d) for the `draft_vocab_size` most frequent tokens; ties go to the lower token id."""
    if not 0 < draft_vocab_size <= len(counts):
        raise ValueError(f"draft_vocab_size {draft_vocab_size} must be in 1..{len(counts)} (the target vocabulary)")
    chosen = np.sort(np.argsort(-counts, kind="stable")[:draft_vocab_size])
    d2t = chosen - np.arange(draft_vocab_size, dtype=np.int64)
    t2d = np.zeros(len(counts), dtype=bool)
    t2d[chosen] = True
    return d2t, t2d


def run_vocab(
    tokens_paths: list[str],
    model_path: str | Path,
    draft_vocab_size: int,
    out_dir: str | Path,
    held_out: Collection[str] = (),
) -> dict:
    vocab_size = target_vocab_size(model_path)
    counts = loss_token_counts(tokens_paths, vocab_size, held_out)
    d2t, t2d = vocab_mapping(counts, draft_vocab_size)
    total = int(counts.sum())
    summary = {
        "target_vocab_size": vocab_size,
        "draft_vocab_size": draft_vocab_size,
        "loss_tokens": total,
        "distinct_loss_tokens": int((counts > 0).sum()),
        "coverage": float(counts[t2d].sum() / total) if total else 0.0,
        "shards": len(tokens_paths),
    }
    with atomic_dir(out_dir) as tmp:
        np.save(tmp / "token_counts.npy", counts)
        write_mapping(tmp, d2t, t2d)
        write_json(tmp / "vocab.json", summary)
    return summary
