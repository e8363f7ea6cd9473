"""A model runner in a process of its own, for a model other than the session's tiny Qwen3.

SGLang builds one model runner per process (a second `init_parallel_runtime` raises), and a fresh
process spends about 25 s of a CI core importing SGLang. The processes here are forked by
multiprocessing's fork server, which imports SGLang once (`PRELOAD`): each costs about 2 s. The fork
server starts with the test process's environment, so SGLang's CPU settings (conftest.py) hold in it.
"""

import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

PRELOAD = [
    "sglang.srt.model_executor.model_runner",
    "sglang.srt.server_args",
    "eagle3_datagen.backends.sglang.capture",
    "eagle3_datagen.backends.hf.capture",
]


def in_own_process(function, *args):
    """`function(*args)` in a new process forked from the fork server; its result or its exception."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    with ProcessPoolExecutor(1, mp_context=context) as pool:
        return pool.submit(function, *args).result()


def capture_with_both_backends(model_dir: Path, batch: list[list[int]], settings: dict, max_batch_tokens: int):
    """The class SGLang ran, the `sglang` backend's states of `batch` (SGLang's runner, tp=1) and the `hf`
    backend's, both with the default auxiliary layers and the normed final layer."""
    from eagle3_datagen.backends.base import SingleProcess
    from eagle3_datagen.backends.hf.capture import HFCapture
    from eagle3_datagen.backends.sglang.capture import CPU_SERVER_FLAGS, SGLangCapture, SGLangModelRunner, server_flags

    flags = server_flags(model_dir, settings, False, max_batch_tokens, tp_size=1)
    runner = SGLangModelRunner([*flags, *CPU_SERVER_FLAGS])
    sglang_states = SGLangCapture(runner, "auto", "normed", ranks=SingleProcess())(batch)
    hf_states = HFCapture(model_dir, "auto", "normed", {"dtype": settings["dtype"], "device": "cpu"})(batch)
    return type(runner.model).__name__, sglang_states, hf_states
