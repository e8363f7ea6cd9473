"""Batches for forward passes: length-sorted within a token budget, padded or packed."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def plan_batches(lengths: Sequence[int], max_batch_tokens: int, packed: bool = False) -> list[list[int]]:
    """Length-sorted batches within the token budget: counted as rows x longest for padded
    forward passes, as the sum of lengths for packed ones."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    batches, current, total = [], [], 0
    for index in order:
        longest = lengths[index]  # sorted ascending: the newcomer is the longest
        size = total + longest if packed else (len(current) + 1) * longest
        if current and size > max_batch_tokens:
            batches.append(current)
            current, total = [], 0
        current.append(index)
        total += longest
    if current:
        batches.append(current)
    return batches


def capture_in_batches(capture, sequences: Sequence[list[int]], max_batch_tokens: int) -> list:
    """`capture`'s states for every token ID list, in order, over budgeted batches; on a
    tensor-parallel rank that does not write, only the forward passes run (and None is returned)."""
    states: list = [None] * len(sequences)
    for batch in plan_batches([len(ids) for ids in sequences], max_batch_tokens, capture.packed):
        batch_states = capture([sequences[i] for i in batch])
        if capture.ranks.writer:
            for i, state in zip(batch, batch_states, strict=True):
                states[i] = state
    return states


def pad_batch(
    sequences: Sequence[Sequence[int]], pad_id: int, side: str = "right"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token IDs [B, longest] padded with `pad_id` on `side` (`right` for a forward pass under a
    causal mask, `left` for generation), and the attention mask (1 on real tokens)."""
    longest = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), longest), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, seq in enumerate(sequences):
        where = slice(0, len(seq)) if side == "right" else slice(longest - len(seq), longest)
        ids[row, where] = torch.tensor(list(seq), dtype=torch.long)
        mask[row, where] = 1
    return ids, mask
