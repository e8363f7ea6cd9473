"""The `vllm` hidden-state backend: vLLM's engine with its `extract_hidden_states` speculative method.

vLLM caches the requested layers' states of every prompt token in a cache-only attention layer
(`eagle_aux_hidden_state_layer_ids`, transformers `hidden_states` indices: embedding output = 0) and,
when the request ends, its KV connector writes them out; ours (`connector.HostHiddenStatesConnector`)
writes one safetensors file per request into a temp folder of this process, read back and removed at
once, so that the shard's parts (`formats.hidden_shard`) are the only copy. The layers asked for are
the auxiliary ones and layer N: vLLM takes each as `hidden_states + residual` after the layer, so the
last slot is layer N's output before the final norm, `final: raw` (what speculators reads; the specforge
export applies the norm). Each prompt is one request of one generated token (greedy), prefix caching off.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch

from eagle3_datagen.backends.base import SingleProcess
from eagle3_datagen.formats.hidden_shard import resolve_aux_layers, split_stacked

CONNECTOR = "HostHiddenStatesConnector"
CONNECTOR_MODULE = "eagle3_datagen.backends.vllm.connector"


def extraction_settings(layer_ids: list[int], storage: str | Path) -> dict:
    """The engine arguments that turn on extraction of `layer_ids` into `storage` (vLLM 0.32.0's
    `SpeculativeConfig` and `KVTransferConfig`)."""
    return {
        "speculative_config": {
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(layer_ids)}},
        },
        "kv_transfer_config": {
            "kv_connector": CONNECTOR,
            "kv_connector_module_path": CONNECTOR_MODULE,
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {"shared_storage_path": str(storage)},
        },
    }


def read_states(path: str | Path) -> dict[str, torch.Tensor]:
    """One request's file (`hidden_states` [T, layers, H], `token_ids` [T]), read once its writer is done
    and removed with its lock file."""
    from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
        cleanup_hidden_states,
        load_hidden_states,
    )

    try:
        return load_hidden_states(str(path))
    finally:
        cleanup_hidden_states(str(path))


class VLLMCapture:
    """A `base.CaptureBackend`: called with a batch of token id lists, returns per sample (aux [T, A*H],
    final [T, H]); the engine schedules the batch itself."""

    packed = True  # vLLM batches by tokens
    ranks = SingleProcess()
    final = "raw"
    model = None  # in vLLM's engine process: no layer check hooks here

    @classmethod
    def for_job(cls, hidden: dict, model: dict) -> VLLMCapture:
        """The capture the `hidden_states` and `model` settings configure (plugins.CaptureBackend)."""
        if hidden["final"] != "raw":
            raise ValueError(
                "hidden_states.backend: vllm captures layer N before the final norm only: set "
                "hidden_states.final: raw (the specforge export applies the norm itself)"
            )
        if hidden["layer_check_samples"]:
            raise ValueError(
                "hidden_states.backend: vllm runs the model in vLLM's engine process, where the layer check's "
                "hooks cannot go: set hidden_states.layer_check_samples: 0, or check with backend hf"
            )
        return cls(model["path"], hidden["aux_layers"], hidden["vllm"], model["trust_remote_code"])

    def __init__(self, model_path: str | Path, aux_spec, settings: dict, trust_remote_code: bool = False):
        if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0":
            # The connector writes a request's file on a later engine step, which an engine in this
            # process only takes inside the next call: reading would wait on the file's lock for ever.
            raise RuntimeError(
                "hidden_states.backend: vllm needs vLLM's engine core in its own process: unset "
                "VLLM_ENABLE_V1_MULTIPROCESSING (it is 0)"
            )
        from transformers import AutoConfig
        from vllm import LLM

        config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code).get_text_config()
        self.num_layers = config.num_hidden_layers
        self.hidden_size = config.hidden_size
        self.aux_layers = resolve_aux_layers(self.num_layers, aux_spec)
        self.model_name = Path(model_path).name
        # removed with this object or at exit: each request's file is removed as soon as it is read
        self._storage = tempfile.TemporaryDirectory(prefix="vllm-states-")
        self.storage = Path(self._storage.name)
        self.llm = LLM(
            model=str(model_path),
            dtype=settings["dtype"],
            trust_remote_code=trust_remote_code,
            enable_prefix_caching=False,  # every token's states computed in full
            **extraction_settings([*self.aux_layers, self.num_layers], self.storage),
            **settings["engine_args"],
        )

    @torch.inference_mode()
    def __call__(self, batch: list[list[int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        prompts = [TokensPrompt(prompt_token_ids=list(ids)) for ids in batch]
        outputs = self.llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
        results = []
        for ids, output in zip(batch, outputs, strict=True):
            saved = read_states((output.kv_transfer_params or {})["hidden_states_path"])
            if saved["token_ids"].tolist() != list(ids):
                raise RuntimeError(
                    f"vLLM saved states of {len(saved['token_ids'])} tokens other than the {len(ids)} it was sent"
                )
            results.append(split_stacked(saved["hidden_states"]))  # the auxiliary layers, then layer N
        return results
