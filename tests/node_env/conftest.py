"""tests/node_env runs under .venv-gpu, the GPU node's SGLang environment: `make test-node-env` builds it."""

import torch

if not torch.version.cuda:  # run by plain `pytest` in a CPU venv: say how to run it
    raise ImportError("tests/node_env runs under .venv-gpu (SGLang's CUDA torch): use `make test-node-env`")
