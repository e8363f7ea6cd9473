"""The `hf` hidden-state backend: transformers forward passes, hooks on the stored layers."""

from __future__ import annotations

from pathlib import Path

import torch

from eagle3_datagen.backends.base import SingleProcess
from eagle3_datagen.backends.batching import pad_batch
from eagle3_datagen.backends.hf.model import load_causal_lm
from eagle3_datagen.formats.hidden_shard import resolve_aux_layers


class HFCapture:
    """Forward passes with transformers; hooks collect only the layers that are stored."""

    packed = False  # right-padded batches
    ranks = SingleProcess()

    @classmethod
    def for_job(cls, hidden: dict, model: dict) -> HFCapture:
        """The capture the `hidden_states` and `model` settings configure (plugins.CaptureBackend)."""
        return cls(model["path"], hidden["aux_layers"], hidden["final"], hidden["hf"], model["trust_remote_code"])

    def __init__(self, model_path: str | Path, aux_spec, final: str, settings: dict, trust_remote_code=False):
        self.lm = load_causal_lm(model_path, settings, trust_remote_code)
        self.model = self.lm
        config = self.lm.config
        self.num_layers = config.num_hidden_layers
        self.hidden_size = config.hidden_size
        self.aux_layers = resolve_aux_layers(self.num_layers, aux_spec)
        self.final = final
        self.model_name = Path(model_path).name

    def _decoder_layers(self):
        return self.lm.model.layers

    @torch.inference_mode()
    def __call__(self, batch: list[list[int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per sample: (aux [T, A*H], final [T, H]) for a batch of token ID lists."""
        device = self.lm.device
        input_ids, mask = pad_batch(batch, pad_id=0, side="right")
        wanted = list(self.aux_layers) + ([self.num_layers] if self.final == "raw" else [])
        captured: dict[int, torch.Tensor] = {}
        hooks = []
        layers = self._decoder_layers()
        for index in set(wanted):

            def keep(_module, _args, output, index=index):
                captured[index] = output[0] if isinstance(output, tuple) else output

            hooks.append(layers[index - 1].register_forward_hook(keep))
        try:
            # Right padding under a causal mask leaves every real token's states unchanged.
            out = self.lm.model(input_ids=input_ids.to(device), attention_mask=mask.to(device))
        finally:
            for hook in hooks:
                hook.remove()
        final = captured[self.num_layers] if self.final == "raw" else out.last_hidden_state
        aux = torch.cat([captured[i] for i in self.aux_layers], dim=-1)
        return [(aux[row, : len(ids)].cpu(), final[row, : len(ids)].cpu()) for row, ids in enumerate(batch)]
