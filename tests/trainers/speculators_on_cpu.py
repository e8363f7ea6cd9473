"""`speculators` (0.9.0) on a CPU, for tests/trainers/test_speculators.py: its Trainer moves the model
and every batch to `get_local_rank()` (device index 0, i.e. cuda:0) and autocasts on "cuda" when no
accelerator is found. This sets both to "cpu"; nothing else (data loading included) is changed."""

import sys

from speculators.cli import app
from speculators.train import trainer

_init = trainer.Trainer.__init__


def _init_on_cpu(self, *args, **kwargs):
    _init(self, *args, **kwargs)
    self.device_type = "cpu"


def main() -> None:
    trainer.get_local_rank = lambda: "cpu"
    trainer.Trainer.__init__ = _init_on_cpu
    sys.exit(app())


if __name__ == "__main__":
    main()
