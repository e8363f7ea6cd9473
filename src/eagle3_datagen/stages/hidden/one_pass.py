"""The `hidden_states` job in one-pass mode (`hidden_states.one_pass`): the states a vLLM responses job staged
(`backends/vllm/one_pass.py`) packed into the usual shard, with no model load."""

from __future__ import annotations

import shutil
from pathlib import Path

from eagle3_datagen.backends.vllm.one_pass import StagedStates
from eagle3_datagen.formats.files import read_jsonl


def pack_states(tokens_path: str | Path, states: str | Path, out: str | Path, hidden: dict, model: dict) -> dict:
    """The `hidden_states` job in one-pass mode: the shard `out` of the staged states `states` for the token
    rows of `tokens_path`, written as a capture writes it; the staged folder is removed once the shard is whole."""
    from eagle3_datagen.stages.hidden.shard import capture_shard, writer_threads  # torch: only a packing job's

    staged = StagedStates(states, model["path"], hidden["aux_layers"])
    samples = staged.samples(read_jsonl(tokens_path))
    hidden = {**hidden, "writer_threads": writer_threads(hidden["writer_threads"], processes=0)}
    index = capture_shard(samples, out, staged, hidden)
    shutil.rmtree(states)
    return index
