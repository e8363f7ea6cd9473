"""Tiny target models for the demo and the tests, built from configs (nothing downloaded)."""

from __future__ import annotations

from pathlib import Path


def build_target(partitions: list[dict], out_dir: str | Path, settings: dict) -> dict:
    """Build a config's `demo` model at `out_dir`: the embedded Qwen3 demo (no `tokenizer`), the tiny Kimi
    (a Kimi-style tiktoken folder) or a family's tiny target (a Hugging Face tokenizer folder). Returns
    build facts for the log."""
    if "tokenizer" not in settings:
        from eagle3_datagen.targets.demo import build_demo_model, training_conversations

        sources = [(part["source"], part["format"]) for part in partitions]
        return build_demo_model(training_conversations(sources), out_dir, settings)
    if (Path(settings["tokenizer"]) / "tiktoken.model").exists():
        from eagle3_datagen.targets.tiny_kimi import build_tiny_kimi

        return build_tiny_kimi(partitions, out_dir, settings)
    from eagle3_datagen.targets.tiny_family import build_tiny_family

    return build_tiny_family(partitions, out_dir, settings)
