"""Loaded at start-up by the `specforge train` processes the SpecForge tests launch (PYTHONPATH).

SpecForge 0.2.0's EAGLE-3 loss (`specforge.core.loss.LogSoftmaxLoss`) is a Triton kernel, which has
no CPU backend ("0 active drivers"). The same module keeps its reference implementation,
`_compute_loss` (the same KL objective in plain torch); the loss is routed to it, run eagerly.
Nothing else of SpecForge is changed.
"""

from specforge.core import loss

_reference = getattr(loss._compute_loss, "_torchdynamo_orig_callable", loss._compute_loss)
loss.LogSoftmaxLoss.apply = staticmethod(_reference)
