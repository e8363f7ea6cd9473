from sglang.srt.models.qwen3_moe import EntryClass  # noqa: F401
