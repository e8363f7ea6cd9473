"""The tokens stage's audit: IDs rebuilt from text against the server's IDs, the shard's counts, and
what the quality gates dropped."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase

from eagle3_datagen.chat.gates import GateTally


class AuditFailure(RuntimeError):
    """Too many semantic mismatches between rebuilt and server token IDs."""


@dataclass
class Audit:
    """Counts for one shard, written as `{shard}.audit.json`."""

    counts: Counter = field(default_factory=Counter)
    comparisons: Counter = field(default_factory=Counter)
    examples: list = field(default_factory=list)
    gated: GateTally = field(default_factory=GateTally)

    def compare(
        self,
        sample_id: str,
        rendered: list[int],
        server: list[int],
        tokenizer: PreTrainedTokenizerBase,
        keep_examples: int,
    ) -> str:
        if rendered == server:
            kind = "exact"
        else:
            rendered_text = tokenizer.decode(rendered, skip_special_tokens=False)
            server_text = tokenizer.decode(server, skip_special_tokens=False)
            kind = "bpe_only" if rendered_text == server_text else "semantic"
            self._keep_example(
                {
                    "id": sample_id,
                    "kind": kind,
                    "rebuilt_ids": rendered[:64],
                    "server_ids": server[:64],
                    "rebuilt_text": rendered_text[:200],
                    "server_text": server_text[:200],
                },
                keep_examples,
            )
        self.comparisons[kind] += 1
        return kind

    def _keep_example(self, example: dict, keep_examples: int) -> None:
        if sum(1 for e in self.examples if e["kind"] == example["kind"]) < keep_examples:
            self.examples.append(example)

    def merge(self, other: Audit, keep_examples: int) -> None:
        self.counts.update(other.counts)
        self.comparisons.update(other.comparisons)
        self.gated.merge(other.gated)
        for example in other.examples:
            self._keep_example(example, keep_examples)

    def summary(self) -> dict:
        compared = sum(self.comparisons.values())
        return {
            "turns_compared": compared,
            **{kind: self.comparisons[kind] for kind in ("exact", "bpe_only", "semantic")},
            "bpe_only_rate": self.comparisons["bpe_only"] / compared if compared else 0.0,
            "semantic_rate": self.comparisons["semantic"] / compared if compared else 0.0,
            "examples": self.examples,
        }
