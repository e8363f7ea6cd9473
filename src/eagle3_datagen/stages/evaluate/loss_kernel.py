"""SpecForge 0.2.0's Triton loss kernel (`LogSoftmaxLoss`) against the reference implementation its own
module keeps (`_compute_loss`), which the CPU path trains with in its place (draft.py). On a GPU both run on
the same logits, target distribution and position mask: equal loss and equal gradient mean that the CPU
path's substitution trains what the released kernel trains."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

# Both compute the same float32 sums in a different order: a few ulps of float32 apart. Each gradient is
# rounded to the logits' dtype, so two of them may differ by one ulp of that dtype (bf16: 2^-7).
MAX_RELATIVE_DIFFERENCE = 1e-4


def loss_inputs(batch: int, length: int, vocab: int, dtype: torch.dtype, device: str, seed: int = 0):
    """Logits as the draft's head emits them (`dtype`), a target distribution (softmax of other logits,
    float32, as SpecForge's target head gives it) and a position mask with a masked-out tail."""
    generator = torch.Generator(device=device).manual_seed(seed)
    logits = torch.randn(batch, length, vocab, generator=generator, device=device).mul(3).to(dtype)
    target = torch.randn(batch, length, vocab, generator=generator, device=device).mul(3).softmax(-1)
    mask = torch.ones(batch, length, 1, device=device)
    mask[:, length * 3 // 4 :] = 0
    return logits, target, mask


def loss_and_gradient(loss_fn: Callable, logits, target, mask) -> tuple[float, torch.Tensor, float]:
    """`loss_fn`'s loss, its gradient with respect to the logits (float32) and the seconds it took."""
    leaf = logits.detach().clone().requires_grad_(True)
    if leaf.is_cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    # the kernel's backward writes into the logits it saved: give it a copy, the leaf keeps its values
    loss = loss_fn(leaf * 1, target, mask)
    loss.backward()
    if leaf.is_cuda:
        torch.cuda.synchronize()
    return float(loss.detach()), leaf.grad.float(), time.perf_counter() - start


def kernel_agreement(kernel: Callable, reference: Callable, logits, target, mask) -> dict:
    """Loss and gradient of `kernel` and `reference` on the same inputs, their differences, and whether
    they agree: the losses within MAX_RELATIVE_DIFFERENCE, the gradients within that or one ulp of the logits'
    dtype, both relative to the reference's loss and largest gradient."""
    loss_k, grad_k, seconds_k = loss_and_gradient(kernel, logits, target, mask)
    loss_r, grad_r, seconds_r = loss_and_gradient(reference, logits, target, mask)
    loss_difference = abs(loss_k - loss_r) / max(abs(loss_r), 1e-12)
    grad_difference = float((grad_k - grad_r).abs().max() / grad_r.abs().max().clamp_min(1e-30))
    return {
        "shape": list(logits.shape),
        "dtype": str(logits.dtype).removeprefix("torch."),
        "loss_kernel": loss_k,
        "loss_reference": loss_r,
        "loss_relative_difference": loss_difference,
        "gradient_max_relative_difference": grad_difference,
        "masked_gradient_zero": bool((grad_k[:, -1] == 0).all()),
        "seconds_kernel": seconds_k,
        "seconds_reference": seconds_r,
        "agree": loss_difference <= MAX_RELATIVE_DIFFERENCE
        and grad_difference <= max(MAX_RELATIVE_DIFFERENCE, torch.finfo(logits.dtype).eps),
    }


def specforge_kernel_agreement(shapes: list[tuple[int, int, int]], dtypes: list[torch.dtype]) -> list[dict]:
    """SpecForge's released kernel against its reference, eager (as the CPU path runs it), on CUDA, for
    each (batch, length, vocab) shape and logits dtype; each shape's first run compiles the kernel, so it
    runs twice and the second's timings are kept."""
    from specforge.core import loss

    kernel = loss.LogSoftmaxLoss.apply
    reference = getattr(loss._compute_loss, "_torchdynamo_orig_callable", loss._compute_loss)
    results = []
    for shape in shapes:
        for dtype in dtypes:
            inputs = loss_inputs(*shape, dtype=dtype, device="cuda")
            kernel_agreement(kernel, reference, *inputs)
            results.append(kernel_agreement(kernel, reference, *inputs))
    return results
