"""Loaded at start-up (PYTHONPATH) by the `specforge train` processes run on the CPU.

SpecForge 0.2.0's EAGLE-3 loss (`specforge.core.loss.LogSoftmaxLoss`) is a Triton kernel, which has
no CPU backend ("0 active drivers"). The same module keeps its reference implementation,
`_compute_loss` (the same KL objective in plain torch); the loss is routed to it, run eagerly (as
TORCHDYNAMO_DISABLE=1 already runs its compiled helpers). Nothing else of SpecForge is changed.
"""

from eagle3_datagen.stages.evaluate.draft import specforge_on_cpu

specforge_on_cpu()
