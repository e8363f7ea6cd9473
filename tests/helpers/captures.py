"""Captures that plant a defect in the states they return: the `hf` capture, then the defect."""

import torch

from eagle3_datagen.backends.hf.capture import HFCapture


class OffByOneCapture(HFCapture):
    """Final states one token early: row j holds the state of row j + 1, as a capture that drops a row writes."""

    def __call__(self, batch):
        return [(aux, torch.cat([final[1:], final[-1:]])) for aux, final in super().__call__(batch)]


class ReversedAuxCapture(HFCapture):
    """The auxiliary layers stored in reverse order (5, 4, 2 where index.json names 2, 4, 5)."""

    def __call__(self, batch):
        n = len(self.aux_layers)
        return [(torch.cat(aux.chunk(n, dim=-1)[::-1], dim=-1), final) for aux, final in super().__call__(batch)]


class AuxOneLayerLateCapture(HFCapture):
    """Each auxiliary slot from the layer after the one index.json names (hidden_states 3, 5, 6 where it names
    2, 4, 5), as a capture that takes a layer's output where its input is meant writes."""

    def __call__(self, batch):
        named = self.aux_layers
        self.aux_layers = [layer + 1 for layer in named]
        try:
            return super().__call__(batch)
        finally:
            self.aux_layers = named
