"""Two drafts decoded on the same held-out prompts (a draft trained on the regenerated data, the baseline
trained on the dataset's own responses): both acceptance lengths, their difference, and a paired
percentile bootstrap interval of the difference over prompts.

Greedy speculative decoding commits the target's own tokens whatever the draft proposes, so both drafts
decode the same outputs of the same prompts and differ only in how many verify steps they take: the
bootstrap resamples prompts and recomputes both figures on each resample, which keeps each prompt's two
figures together (what the prompt's length and difficulty do to both cancels in the difference). Shared
by the evaluate stage and the report's data curve (`reporting/curve.py`), below both.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence


def prompt_figures(per_prompt: Sequence[Mapping]) -> dict[str, tuple[int, int]]:
    """{prompt id: (committed tokens, verify steps)} from `measure.evaluate_partition`'s `per_prompt`
    (each prompt's `accepted` proposals per verify step; a step commits them and its bonus token)."""
    return {p["id"]: (sum(p["accepted"]) + len(p["accepted"]), len(p["accepted"])) for p in per_prompt}


def _ratio(figures: Sequence[tuple[int, int]]) -> float:
    return sum(c for c, _ in figures) / sum(s for _, s in figures)


def paired_comparison(
    draft: Mapping[str, tuple[int, int]], baseline: Mapping[str, tuple[int, int]], reps: int = 2000, seed: int = 0
) -> dict:
    """`draft` and `baseline`: {prompt id: (committed tokens, verify steps)} on the same prompts. Returns
    acceptance.json's `baseline` (what the report reads): the baseline's acceptance length (summed committed
    tokens / summed verify steps, as SGLang's), the difference draft - baseline and its 95% percentile
    bootstrap interval over `reps` resamples of the prompts (fixed `seed`), and the draft's length beside
    them. Prompts without a verify step in either (an answer that ended at its first token) are left out
    of the resamples, as they hold no ratio."""
    if set(draft) != set(baseline):
        only = sorted(set(draft) ^ set(baseline))
        raise ValueError(f"the two drafts were decoded on different prompts: {len(only)} in one only, e.g. {only[:3]}")
    ids = sorted(draft)
    if not sum(draft[i][1] for i in ids) or not sum(baseline[i][1] for i in ids):
        raise ValueError(f"no verify step in {len(ids)} held-out prompts: no acceptance length to compare")
    first, second = _ratio([draft[i] for i in ids]), _ratio([baseline[i] for i in ids])
    pairs = [(draft[i], baseline[i]) for i in ids if draft[i][1] and baseline[i][1]]
    rng = random.Random(seed)
    differences = []
    for _ in range(reps):
        picks = [pairs[rng.randrange(len(pairs))] for _ in pairs]
        differences.append(_ratio([d for d, _ in picks]) - _ratio([b for _, b in picks]))
    differences.sort()
    tail = 0.025
    return {
        "acceptance_length": second,
        "difference": first - second,
        "difference_interval_95": [differences[int(tail * (reps - 1))], differences[int((1 - tail) * (reps - 1))]],
        "draft_acceptance_length": first,
        "prompts": len(ids),
        "prompts_resampled": len(pairs),
        "reps": reps,
        "seed": seed,
    }
