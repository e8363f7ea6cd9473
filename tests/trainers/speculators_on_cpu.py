"""`speculators` (0.9.0) on a CPU, for tests/trainers/test_speculators.py: its Trainer moves the model
and every batch to `get_local_rank()` (device index 0, i.e. cuda:0), autocasts on "cuda" when no
accelerator is found, and its step timer calls `torch.accelerator.synchronize()`, which raises without
an accelerator. This sets the first two to "cpu" and makes the third a no-op; nothing else (data loading
included) is changed."""

import sys

import torch
from speculators.cli import app
from speculators.train import trainer

_init = trainer.Trainer.__init__


def _init_on_cpu(self, *args, **kwargs):
    _init(self, *args, **kwargs)
    self.device_type = "cpu"


def main() -> None:
    trainer.get_local_rank = lambda: "cpu"
    torch.accelerator.synchronize = lambda *args, **kwargs: None  # nothing to wait for on a CPU
    trainer.Trainer.__init__ = _init_on_cpu
    sys.exit(app())


if __name__ == "__main__":
    main()
