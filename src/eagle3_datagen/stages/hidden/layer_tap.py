"""Every decoder layer of a few samples, recorded by hooks of its own beside the capture, for the layer check.

The capture stores a few layers (the auxiliary ones, the final before or after its norm) chosen by its own
code: `resolve_aux_layers`, the backend's hooks or SGLang's `layers_to_capture`, the `final` setting. A
wrong choice there (a reversed list, a layer id one off, a final slot without its norm) gives states that
look fine and pass the probe. `record_layers` runs the capture once more on each of a few samples with
hooks on the model the capture already loaded (no second load), and keeps what the model computes at
every layer, named by module order alone: `hidden_states[0]` the embedding's output, `hidden_states[i]`
decoder layer i-1's output (the residual stream, `x + residual` where SGLang hands the two apart),
`final, raw` the final norm's input and `final, normed` its output. `diagnostics/layer_check.py`
compares the stored slots with these.

Only a spread of each sample's positions is kept (`POSITIONS`): Kimi-K2.5's 62 layers of 7168 floats
for every token of a sample would be about 1.8 MB a token.
"""

from __future__ import annotations

from pathlib import Path

import torch

from eagle3_datagen.formats.files import atomic_path

POSITIONS = 32


def decoder_stack(model: torch.nn.Module, num_layers: int) -> torch.nn.Module:
    """The module that holds the `num_layers` decoder layers (`layers`) and the final norm (`norm`):
    transformers' `model.model`, SGLang's model class's `model` (or a wrapped language model's; a vision
    tower's own layers are another count)."""
    for module in model.modules():
        layers = getattr(module, "layers", None)
        if isinstance(layers, torch.nn.ModuleList) and len(layers) == num_layers and hasattr(module, "norm"):
            return module
    raise RuntimeError(f"{type(model).__name__}: no module with {num_layers} decoder `layers` and a final `norm`")


def _stream(output) -> torch.Tensor:
    """A decoder layer's residual stream: its output, or SGLang's (hidden_states, residual) summed."""
    if isinstance(output, torch.Tensor):
        return output
    first, second = output[0], output[1] if len(output) > 1 else None
    if isinstance(second, torch.Tensor) and second.shape == first.shape:
        return first + second
    return first


class LayerTap:
    """Hooks on the embedding, every decoder layer and the final norm of `stack`; `taken` holds, per name,
    the rows `positions` of the last forward pass (one sample: [T, H], or [1, T, H])."""

    def __init__(self, stack: torch.nn.Module):
        self.stack = stack
        self.positions: torch.Tensor | None = None
        self.taken: dict[str, torch.Tensor] = {}
        self._hooks: list = []

    def _keep(self, name: str, tensor: torch.Tensor) -> None:
        rows = tensor.reshape(-1, tensor.shape[-1])
        # a copy now: a fused add-norm overwrites its inputs in place
        self.taken[name] = rows[self.positions.to(rows.device)].float().cpu()

    def __enter__(self) -> LayerTap:
        hooks, stack = self._hooks, self.stack
        if hasattr(stack, "embed_tokens"):
            keep_embedding = lambda _m, _a, out: self._keep("hidden_states[0]", _stream(out))  # noqa: E731
            hooks.append(stack.embed_tokens.register_forward_hook(keep_embedding))
        for i, layer in enumerate(stack.layers):
            keep_layer = lambda _m, _a, out, name=f"hidden_states[{i + 1}]": self._keep(name, _stream(out))  # noqa: E731
            hooks.append(layer.register_forward_hook(keep_layer))

        def keep_norm_input(_module, args, kwargs):
            values = [*args, *kwargs.values()]
            x, residual = values[0], values[1] if len(values) > 1 else None
            self._keep("final, raw", x + residual if isinstance(residual, torch.Tensor) else x)

        hooks.append(stack.norm.register_forward_pre_hook(keep_norm_input, with_kwargs=True))
        keep_norm_output = lambda _m, _a, out: self._keep("final, normed", _normed(out))  # noqa: E731
        hooks.append(stack.norm.register_forward_hook(keep_norm_output))
        return self

    def __exit__(self, *exc) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()


def _normed(output) -> torch.Tensor:
    # SGLang's fused RMSNorm(x, residual) returns (normed, x + residual)
    return output if isinstance(output, torch.Tensor) else output[0]


def spread_positions(length: int, count: int = POSITIONS) -> torch.Tensor:
    """`count` positions spread over a sample of `length` tokens, the first and the last among them."""
    return torch.linspace(0, length - 1, min(count, length)).round().long().unique()


def record_layers(capture, model: torch.nn.Module, samples: list[dict], count: int, path: str | Path) -> list[str]:
    """Run `capture` on each of the `count` shortest `samples` alone under a `LayerTap` on `model` (the
    module the capture loaded) and write every layer at a spread of positions to `path` (safetensors:
    `{id}/positions` and `{id}/{name}`), on the writer rank. Under tensor parallelism every rank calls
    this. Returns the samples' ids."""
    from safetensors.torch import save

    chosen = sorted(samples, key=lambda s: (len(s["input_ids"]), s["id"]))[:count]
    tensors: dict[str, torch.Tensor] = {}
    with LayerTap(decoder_stack(model, capture.num_layers)) as tap, torch.inference_mode():
        for sample in chosen:
            tap.positions = spread_positions(len(sample["input_ids"]))
            tap.taken.clear()
            capture([list(sample["input_ids"])])
            tensors[f"{sample['id']}/positions"] = tap.positions
            tensors.update({f"{sample['id']}/{name}": t.contiguous() for name, t in tap.taken.items()})
    if capture.ranks.writer:
        with atomic_path(path) as tmp:
            tmp.write_bytes(save(tensors))  # save_file would leave the file 0600
    return [s["id"] for s in chosen]
