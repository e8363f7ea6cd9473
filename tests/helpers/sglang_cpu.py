"""SGLang's settings on the CPU, for tests/real_sglang (whose conftest.py applies the environment) and the
processes it starts. Imports no SGLang."""

import os

import torch

from eagle3_datagen.config_schema import fill_defaults
from tests.helpers import REPO

CPU_DIR = REPO / "tests" / "real_sglang" / "cpu"
SGLANG_CPU_ENV = {
    "SGLANG_USE_CPU_ENGINE": "1",
    "SGLANG_EXTERNAL_MODEL_PACKAGE": "sglang_test_models",
    "PYTHONPATH": os.pathsep.join(filter(None, [str(CPU_DIR), os.environ.get("PYTHONPATH")])),
}

# On the CPU, SGLang sizes its KV cache from the machine's free memory, measured before and after the
# weights load: at a static fraction of 0.05, another process taking 5% of free memory meanwhile fails
# the start ("Loaded weights leave no GPU memory"). max_total_tokens caps the cache at what the tests need.
CPU_MEM_FRACTION_STATIC = 0.5
# Small enough for a CI core, large enough that the KV cache holds every test batch.
CPU_CAPTURE_SETTINGS = fill_defaults(
    {"dtype": "float32", "mem_fraction_static": CPU_MEM_FRACTION_STATIC, "server_args": {"max_total_tokens": 4096}},
    "hidden_states.sglang",
)
MAX_BATCH_TOKENS = 64


# `sglang.launch_server` on a CPU, as the issue found it starts (about a minute of imports). --sleep-on-idle:
# an idle scheduler otherwise polls its sockets without pause, a whole core for as long as the server is up
# (measured: 15 CPU s in 15 s idle; 1 CPU s with it), taken from the tests and jobs beside it.
CPU_LAUNCH_ARGS = [
    "--device", "cpu", "--attention-backend", "torch_native", "--sampling-backend", "pytorch",
    "--grammar-backend", "none", "--cuda-graph-backend-decode", "disabled",
    "--cuda-graph-backend-prefill", "disabled", "--mem-fraction-static", str(CPU_MEM_FRACTION_STATIC),
    "--max-total-tokens", "4096", "--dtype", "float32", "--disable-radix-cache", "--sleep-on-idle",
]  # fmt: skip


def greedy(hf_model, prompt_ids, max_new_tokens):
    """transformers' greedy continuation of `prompt_ids`: what the served model must answer at temperature 0."""
    out = hf_model.generate(
        torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    return out[0, len(prompt_ids) :].tolist()
