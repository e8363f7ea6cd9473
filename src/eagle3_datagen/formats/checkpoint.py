"""What a model directory says about itself, read without loading the model."""

from __future__ import annotations

import json
from pathlib import Path

SAFETENSORS_INDEX = "model.safetensors.index.json"


def text_config(model_path: str | Path) -> dict:
    """The language model's config.json settings (a multimodal checkpoint nests them in `text_config`)."""
    config = json.loads((Path(model_path) / "config.json").read_text())
    return config.get("text_config", config)


def tensor_files(model_dir: str | Path) -> dict[str, Path]:
    """Tensor name -> file, from the safetensors index or the single checkpoint file."""
    from safetensors import safe_open

    model_dir = Path(model_dir)
    index = model_dir / SAFETENSORS_INDEX
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: model_dir / file for name, file in weight_map.items()}
    single = model_dir / "model.safetensors"
    if not single.exists():
        raise FileNotFoundError(f"{model_dir}: no {SAFETENSORS_INDEX} or model.safetensors")
    with safe_open(str(single), "pt") as f:
        return dict.fromkeys(f.keys(), single)


def one_named(names: list[str], suffix: str) -> str | None:
    """The shortest tensor name ending in `suffix` (the language model's, in a multimodal checkpoint)."""
    matches = sorted((n for n in names if n == suffix or n.endswith("." + suffix)), key=len)
    return matches[0] if matches else None


def head_and_norm_names(model_dir: str | Path, files: dict[str, Path]) -> tuple[str, str]:
    """The LM head's tensor (the embedding when the head is tied) and the final norm's."""
    names = list(files)
    head = one_named(names, "lm_head.weight")
    if head is None and text_config(model_dir).get("tie_word_embeddings", False):
        head = one_named(names, "embed_tokens.weight")
    norm = one_named(names, "model.norm.weight") or one_named(names, "norm.weight")
    if head is None or norm is None:
        raise KeyError(f"{model_dir}: cannot find the LM head and final norm tensors among {len(names)} tensors")
    return head, norm


def read_tensor(path: Path, name: str):
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return f.get_tensor(name)


def rms_norm(hidden, weight, eps: float):
    """The final RMS norm in float32: weight * h / sqrt(mean(h^2) + eps)."""
    import torch

    hidden = hidden.float()
    return weight.float() * hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + eps)


class FinalNorm:
    """The target model's final RMS norm (weight and `rms_norm_eps`), read without loading the model."""

    def __init__(self, model_dir: str | Path):
        files = tensor_files(model_dir)
        self.name = head_and_norm_names(model_dir, files)[1]
        self.weight = read_tensor(files[self.name], self.name).float()
        self.eps = float(text_config(model_dir).get("rms_norm_eps", 1e-6))

    def __call__(self, hidden):
        """The normed state, computed in float32 and cast back to `hidden`'s dtype."""
        return rms_norm(hidden, self.weight, self.eps).to(hidden.dtype)


def safetensors_sizes(path: Path) -> dict[str, int]:
    """Each tensor's bytes in a safetensors file, from its header alone (the file's first bytes)."""
    with path.open("rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    return {
        name: end - start
        for name, (start, end) in ((n, e["data_offsets"]) for n, e in header.items() if n != "__metadata__")
    }


def tensor_bytes(model_dir: str | Path) -> dict[str, int]:
    """Tensor name -> its bytes in the checkpoint, read from the safetensors headers."""
    files = tensor_files(model_dir)
    sizes: dict[str, int] = {}
    for path in sorted(set(files.values())):
        sizes.update(safetensors_sizes(path))
    return {name: sizes[name] for name in files}


def write_safetensors_index(model_dir: str | Path) -> None:
    """`model.safetensors.index.json` for a checkpoint saved as one `model.safetensors`: loaders that
    locate tensors only through an index (SpecForge's target head) then read it as a sharded one."""
    model_dir = Path(model_dir)
    single = model_dir / "model.safetensors"
    sizes = safetensors_sizes(single)
    index = {
        "metadata": {"total_size": sum(sizes.values())},
        "weight_map": dict.fromkeys(sorted(sizes), single.name),
    }
    (model_dir / SAFETENSORS_INDEX).write_text(json.dumps(index, indent=2) + "\n")
