"""What requests cost: dollars and prompt + completion tokens, as journals, the run-wide ledger, the limits
and a failed request's bill (`RetryableError.lost`) count them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Spend:
    """Dollars and prompt + completion tokens."""

    cost: float = 0.0
    tokens: int = 0

    def __add__(self, other: Spend) -> Spend:
        return Spend(self.cost + other.cost, self.tokens + other.tokens)

    def __sub__(self, other: Spend) -> Spend:
        return Spend(self.cost - other.cost, self.tokens - other.tokens)

    def __bool__(self) -> bool:
        return bool(self.cost or self.tokens)

    @classmethod
    def of(cls, entry: dict) -> Spend:
        """A spend as `as_dict` wrote it."""
        return cls(float(entry.get("cost") or 0.0), int(entry.get("tokens") or 0))

    @classmethod
    def of_usage(cls, usage: dict | None) -> Spend:
        """What an OpenAI-style `usage` says was paid, with what a turn's earlier cut attempts were billed
        (`lost_cost`, `lost_tokens`: the journal's turns carry them)."""
        usage = usage or {}
        tokens = (usage.get("prompt_tokens") or 0) + (usage.get("completion_tokens") or 0)
        return cls((usage.get("cost") or 0.0) + usage.get("lost_cost", 0.0), tokens + usage.get("lost_tokens", 0))

    def as_dict(self) -> dict:
        return {"cost": round(self.cost, 9), "tokens": self.tokens}
