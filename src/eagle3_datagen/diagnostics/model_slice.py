"""What the GPU check loads: the whole checkpoint where two copies fit the GPUs, else its first layers.

The GPU check holds the model twice at once, SGLang's model runner beside transformers: Kimi-K2.5's
~600 GB cannot be loaded twice on its 8 GPUs. Where one copy of the checkpoint takes more than
`ENGINE_SHARE` of the GPUs' memory, both engines load a slice of the same checkpoint instead: its
first `SLICE_LAYERS` decoder layers (`write_slice`: the config's `num_hidden_layers` cut, the
safetensors index narrowed to those layers' tensors and the rest of the model's, links to the files
holding them), so each reads only those tensors. The kernels, the quantization and the way each engine
hands over the states are the same on the slice as on the whole model; the week's auxiliary layers
themselves are checked by the smoke run's layer check, from the capture runner's hooks.

This module reads headers only: the smoke process plans with it without importing torch.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from eagle3_datagen.formats.checkpoint import SAFETENSORS_INDEX, one_named, tensor_bytes, tensor_files

# SGLang's runner takes mem_fraction_static 0.5 of each GPU (its weights and KV cache), transformers'
# copy the other half (device_map auto, over the memory left free): each copy within 80% of its half.
ENGINE_SHARE = 0.4
# The fewest layers whose `auto` auxiliary layers [2, N//2, N-3] are distinct: [2, 3, 4].
SLICE_LAYERS = 7
GB = 1e9


@dataclass(frozen=True)
class CheckSize:
    """The layers the GPU check compares and the checkpoint bytes each engine loads for them."""

    layers: int
    model_layers: int
    bytes: int
    checkpoint_bytes: int
    gpu_bytes: int | None  # the GPUs' memory it was sized against (None: not sized, on a CPU or as told)

    @property
    def whole(self) -> bool:
        return self.layers == self.model_layers

    def describe(self) -> str:
        loaded = f"{self.bytes / GB:.1f} GB of the checkpoint's {self.checkpoint_bytes / GB:.1f} GB"
        if self.whole:
            return f"the whole model, {self.model_layers} layers ({loaded} per engine)"
        why = (
            f"one copy is over {ENGINE_SHARE:.0%} of the GPUs' {self.gpu_bytes / GB:.0f} GB"
            if self.gpu_bytes
            else "as told"
        )
        return f"the first {self.layers} of {self.model_layers} layers ({loaded} per engine; {why})"


def decoder_layers_prefix(names: list[str]) -> str:
    """The decoder layers' tensor prefix (`model.layers.`; a multimodal checkpoint's language model's,
    e.g. `language_model.model.layers.`), beside the embedding's."""
    embedding = one_named(names, "embed_tokens.weight")
    if embedding is None:
        raise KeyError(f"no embed_tokens.weight among {len(names)} tensors: cannot find the decoder layers")
    return embedding.removesuffix("embed_tokens.weight") + "layers."


def layer_of(name: str, prefix: str) -> int | None:
    """The decoder layer a tensor belongs to (None for the embedding, head, norms, a vision tower)."""
    match = re.match(re.escape(prefix) + r"(\d+)\.", name)
    return int(match.group(1)) if match else None


def size_check(sizes: dict[str, int], model_layers: int, gpu_bytes: int | None, layers: int | None = None) -> CheckSize:
    """The check's layers for a checkpoint of `sizes` (tensor -> bytes) and `model_layers` layers: `layers`
    where given, else the whole model where one copy fits `ENGINE_SHARE` of `gpu_bytes` (or no GPU memory is
    known), else `SLICE_LAYERS`."""
    prefix = decoder_layers_prefix(list(sizes))
    total = sum(sizes.values())
    if layers is None:
        fits = gpu_bytes is None or total <= ENGINE_SHARE * gpu_bytes
        layers = model_layers if fits else min(SLICE_LAYERS, model_layers)
    if not 1 <= layers <= model_layers:
        raise ValueError(f"cannot check {layers} layers of a {model_layers}-layer model")
    kept = sum(b for name, b in sizes.items() if (layer_of(name, prefix) or 0) < layers)
    if gpu_bytes is not None and kept > ENGINE_SHARE * gpu_bytes:
        raise ValueError(
            f"even {layers} layers ({kept / GB:.1f} GB) are over {ENGINE_SHARE:.0%} of the GPUs' "
            f"{gpu_bytes / GB:.0f} GB: run the GPU check where two copies of them fit"
        )
    return CheckSize(layers, model_layers, kept, total, gpu_bytes)


def _layer_config(config: dict) -> dict:
    return config.get("text_config", config)


def check_size(model_dir: str | Path, gpu_bytes: int | None, layers: int | None = None) -> CheckSize:
    """`size_check` for a model directory, read from its config and safetensors headers."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return size_check(tensor_bytes(model_dir), int(_layer_config(config)["num_hidden_layers"]), gpu_bytes, layers)


def write_slice(model_dir: str | Path, layers: int, out_dir: str | Path) -> Path:
    """The checkpoint's first `layers` decoder layers as a model directory of links (see the module's
    docstring): its config and safetensors index written, every other file linked, so that SGLang and
    transformers load the same tensors from the same files."""
    model_dir, out_dir = Path(model_dir).resolve(), Path(out_dir)
    files = tensor_files(model_dir)
    prefix = decoder_layers_prefix(list(files))
    kept = {name: path.name for name, path in files.items() if (layer_of(name, prefix) or 0) < layers}
    config = json.loads((model_dir / "config.json").read_text())
    layer_config = _layer_config(config)
    layer_config["num_hidden_layers"] = layers
    if isinstance(layer_config.get("layer_types"), list):  # one entry a layer (hybrid attention)
        layer_config["layer_types"] = layer_config["layer_types"][:layers]
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    tmp.mkdir(parents=True)
    for path in sorted(model_dir.iterdir()):
        weights = path.suffix == ".safetensors"
        if path.name in ("config.json", SAFETENSORS_INDEX) or (weights and path.name not in kept.values()):
            continue
        (tmp / path.name).symlink_to(path)
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    index = {"metadata": {"sliced_from": str(model_dir), "layers": layers}, "weight_map": dict(sorted(kept.items()))}
    (tmp / SAFETENSORS_INDEX).write_text(json.dumps(index, indent=2) + "\n")
    tmp.rename(out_dir)
    return out_dir
