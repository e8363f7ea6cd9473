"""The draft vocabulary's files (`results/vocab/`), as the trainers read them.

`d2t.npy` / `t2d.npy` are what vLLM speculators' `--d2t-path` / `--t2d-path` take; `vocab_mapping.pt`
holds the same two as the one `torch.save({"d2t", "t2d"})` file SpecForge 0.2.0's
`load_vocab_mapping` loads (it cannot read the `.npy` files).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

D2T, T2D, VOCAB_MAPPING = "d2t.npy", "t2d.npy", "vocab_mapping.pt"


def write_mapping(directory: Path, d2t: np.ndarray, t2d: np.ndarray) -> None:
    np.save(directory / D2T, d2t)
    np.save(directory / T2D, t2d)
    torch.save({"d2t": torch.from_numpy(d2t).long(), "t2d": torch.from_numpy(t2d).bool()}, directory / VOCAB_MAPPING)
