"""Exporters from packed hidden-state shards to the layouts trainers read.

- `specforge`: SpecForge's offline layout, one `torch.save` dict per sample in
  `rows_{a}-{b}/data_{i}.ckpt` with `input_ids` [L], `loss_mask` [L], `hidden_state`
  [1, L, H] (the final layer) and `aux_hidden_state` [1, L, A*H].
- `speculators`: vLLM speculators' `hs_{i}.safetensors` with `token_ids` [L] and
  `hidden_states` [L, A+1, H], auxiliary layers in order and the final layer last, plus
  `loss_mask` [L].

Both number samples in shard order and write `ids.jsonl` (index -> sample id), so no sample
loses its source id; the directory appears only when complete.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import orjson
import torch
from safetensors.torch import save_file

from eagle3_datagen.formats.files import atomic_dir, write_json
from eagle3_datagen.formats.hidden_shard import HiddenShard

FORMATS = ("specforge", "speculators")
SPECFORGE_ROWS_PER_DIR = 1000


def _samples(shard_dirs: list[str | Path]) -> Iterator[tuple[dict, int]]:
    """Every sample of the shards in order, with its layer count (aux layers)."""
    for shard_dir in shard_dirs:
        shard = HiddenShard(shard_dir)
        for sample in shard:
            yield sample, len(shard.index["aux_layers"])


def _specforge(sample: dict, aux_layers: int) -> dict:
    return {
        "input_ids": sample["input_ids"].long(),
        "loss_mask": sample["loss_mask"].long(),
        "hidden_state": sample["hidden_states"].unsqueeze(0).contiguous(),
        "aux_hidden_state": sample["aux_hidden_states"].unsqueeze(0).contiguous(),
    }


def _speculators(sample: dict, aux_layers: int) -> dict:
    length, hidden = sample["hidden_states"].shape
    aux = sample["aux_hidden_states"].reshape(length, aux_layers, hidden)
    return {
        "token_ids": sample["input_ids"].long(),
        "hidden_states": torch.cat([aux, sample["hidden_states"].unsqueeze(1)], dim=1).contiguous(),
        "loss_mask": sample["loss_mask"].long(),
    }


def export(shard_dirs: list[str | Path], out_dir: str | Path, fmt: str) -> dict:
    if fmt not in FORMATS:
        raise ValueError(f"export format must be one of {FORMATS}, not {fmt!r}")
    count = tokens = 0
    with atomic_dir(out_dir) as tmp, (tmp / "ids.jsonl").open("wb") as ids:
        for index, (sample, aux_layers) in enumerate(_samples(shard_dirs)):
            if fmt == "specforge":
                start = index - index % SPECFORGE_ROWS_PER_DIR
                rows = tmp / f"rows_{start}-{start + SPECFORGE_ROWS_PER_DIR}"
                rows.mkdir(exist_ok=True)
                torch.save(_specforge(sample, aux_layers), rows / f"data_{index}.ckpt")
            else:
                save_file(_speculators(sample, aux_layers), str(tmp / f"hs_{index}.safetensors"))
            ids.write(orjson.dumps({"index": index, "id": sample["id"]}) + b"\n")
            count += 1
            tokens += len(sample["input_ids"])
        summary = {"format": fmt, "samples": count, "tokens": tokens, "shards": [str(d) for d in shard_dirs]}
        write_json(tmp / "export.json", summary)
    return summary
