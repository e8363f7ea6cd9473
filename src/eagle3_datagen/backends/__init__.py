"""Backends side by side behind the interfaces in `base`: generation (hf, sglang, openrouter)
and hidden-state capture (hf, sglang)."""
