"""What a model directory says about itself, read without loading the model."""

from __future__ import annotations

import json
from pathlib import Path


def text_config(model_path: str | Path) -> dict:
    """The language model's config.json settings (a multimodal checkpoint nests them in `text_config`)."""
    config = json.loads((Path(model_path) / "config.json").read_text())
    return config.get("text_config", config)
