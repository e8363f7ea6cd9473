from sglang.srt.models.qwen3 import EntryClass  # noqa: F401
