"""Loaded at start-up (PYTHONPATH) by the `specforge train` processes run on the CPU.

SpecForge 0.2.0's EAGLE-3 loss (`specforge.core.loss.LogSoftmaxLoss`) is a Triton kernel, which has
no CPU backend ("0 active drivers"). The same module keeps its reference implementation,
`_compute_loss` (the same KL objective in plain torch); the loss is routed to it, run eagerly.
Nothing else of SpecForge is changed.
"""

from eagle3_datagen.stages.evaluate.draft import use_reference_loss

use_reference_loss()
