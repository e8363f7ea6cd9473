"""Loading the target model with transformers, on CPU or across one node's GPUs."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def load_causal_lm(model_path: str | Path, settings: dict, trust_remote_code: bool = False) -> PreTrainedModel:
    """`settings`: `dtype` and `device` (`cpu`, or `cuda` to spread the model over all visible GPUs)."""
    return AutoModelForCausalLM.from_pretrained(
        str(model_path),
        trust_remote_code=trust_remote_code,
        local_files_only=True,
        dtype=DTYPES[settings["dtype"]],
        device_map="auto" if settings["device"] == "cuda" else None,
    ).eval()
