"""A stand-in for SGLang's model runner, built around a transformers Qwen3, for CPU tests.

It reproduces the contract `capture_sglang.SGLangCapture` relies on, not SGLang's kernels:
- the batch runs packed, as one flat sequence of tokens;
- the decoder stack carries a residual stream: layer k's input is `hidden + residual`, and
  `set_eagle3_layers_to_capture(ids)` captures the inputs of layers `id + 1`;
- the final norm is a fused add-norm called as `norm(hidden, residual)` that overwrites both
  arguments in place (as SGLang's CUDA kernel does);
- the logits processor is called as `(input_ids, hidden_states, lm_head, forward_batch, aux)`;
- with tensor parallelism every extend is a collective, so ranks out of step hang.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


class FusedAddNorm(nn.Module):
    def __init__(self, norm: nn.Module):
        super().__init__()
        self.inner = norm

    def forward(self, x, residual=None):
        if residual is None:
            return self.inner(x)
        residual.add_(x)
        x.copy_(self.inner(residual))
        return x, residual


class DecoderStack(nn.Module):
    """Holds the per-token states of each layer of the wrapped model as SGLang's stream would."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.hf = model.model
        self.norm = FusedAddNorm(model.model.norm)
        self.layers_to_capture: list[int] = []

    def forward(self, batch: list[list[int]]):
        per_layer: dict[int, list[torch.Tensor]] = {}
        hooks = [
            layer.register_forward_hook(
                lambda _m, _a, out, k=k: per_layer.setdefault(k, []).append(out[0] if isinstance(out, tuple) else out)
            )
            for k, layer in enumerate(self.hf.layers, start=1)
        ]
        try:
            embeds = []
            for ids in batch:
                ids = torch.tensor([ids])
                embeds.append(self.hf.embed_tokens(ids)[0])
                self.hf(input_ids=ids)
        finally:
            for hook in hooks:
                hook.remove()
        # h[k]: packed output of layer k (h[0] the embeddings); SGLang splits it as
        # hidden = h[k] - h[k-1] (the layer's update) and residual = h[k-1].
        h = [torch.cat(embeds)] + [torch.cat([t[0] for t in per_layer[k]]) for k in range(1, len(self.hf.layers) + 1)]
        aux = [h[k].clone() for k in self.layers_to_capture]
        n = len(self.hf.layers)
        hidden, residual = (h[n] - h[n - 1]).contiguous(), h[n - 1].clone()
        hidden, _ = self.norm(hidden, residual)
        return hidden, aux


class LogitsProcessor(nn.Module):
    def forward(self, input_ids, hidden_states, lm_head, forward_batch, aux_hidden_states=None):
        return lm_head(hidden_states[-1:])


class CausalLM(nn.Module):
    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = DecoderStack(model)
        self.lm_head = model.lm_head
        self.logits_processor = LogitsProcessor()
        self.capture_aux_hidden_states = False

    def set_eagle3_layers_to_capture(self, layer_ids):
        self.capture_aux_hidden_states = True
        self.model.layers_to_capture = [k + 1 for k in layer_ids]

    def forward(self, batch):
        hidden, aux = self.model(batch)
        flat = torch.tensor([t for ids in batch for t in ids])
        return self.logits_processor(flat, hidden, self.lm_head, None, aux if self.capture_aux_hidden_states else None)


class StandInRunner:
    """The attributes of `capture_sglang.SGLangModelRunner` that `SGLangCapture` uses."""

    def __init__(self, model_dir):
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.model = CausalLM(hf)
        self.hf_config = hf.config
        self.model_name = model_dir.name
        self.extends = 0

    @torch.inference_mode()
    def extend(self, batch):
        self.extends += 1
        if dist.is_initialized():
            dist.all_reduce(torch.ones(1))  # a tensor-parallel forward is a collective
        self.model(batch)
