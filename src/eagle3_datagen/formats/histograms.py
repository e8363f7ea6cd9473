"""Length histograms with fixed power-of-two bins, so shards' histograms add up exactly."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable


def bin_floor(value: int) -> int:
    """The lower edge of `value`'s bin: 0, 1, then powers of two ([2, 4), [4, 8), ...)."""
    return 0 if value <= 0 else 1 << (int(value).bit_length() - 1)


def histogram(values: Iterable[int]) -> dict[str, int]:
    """Counts keyed by each bin's lower edge (JSON keys are strings), in ascending order."""
    counts = Counter(bin_floor(v) for v in values)
    return {str(edge): counts[edge] for edge in sorted(counts)}


def merge(histograms: Iterable[dict[str, int]]) -> dict[str, int]:
    total: Counter = Counter()
    for h in histograms:
        total.update({int(k): v for k, v in h.items()})
    return {str(edge): total[edge] for edge in sorted(total)}
