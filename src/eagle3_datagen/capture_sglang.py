"""The `sglang` hidden-state backend: SGLang's in-process model runner, tensor parallel.

One process per GPU (`torchrun --nproc-per-node {tp} scripts/hidden_states.py ...`). Every rank
runs the same plan in lockstep, because each forward pass is a collective; rank 0 decides which
parts an earlier run already finished, broadcasts that decision, and alone writes files.

States are taken where SGLang's own EAGLE-3 support takes them, so they match what a draft model
sees when served: the auxiliary layers through `set_eagle3_layers_to_capture` (handed to the
logits processor), the normed final state as the logits processor's input, and the raw layer-N
output as the final norm's `x + residual`. Extend batches are packed (no padding); prefix caching,
chunked prefill and CUDA graphs are off so every state is computed in full for every token.

Only `SGLangModelRunner` touches SGLang's internals (ServerArgs, ModelRunner, ScheduleBatch,
ForwardBatch), which change between releases: envs/sglang.yaml pins the release it was written
for, and `scripts/gpu_check.py` compares this backend with `hf` layer by layer on a GPU.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist

from .hidden import resolve_aux_layers


class TensorParallelRanks:
    """Lockstep helpers over the ranks torchrun started; rank 0 is the writer."""

    def __init__(self):
        self.writer = dist.get_rank() == 0
        # Python objects travel over a CPU group: NCCL would need them staged on a GPU.
        self._group = dist.new_group(backend="gloo")

    def agree(self, value):
        """Rank 0's `value`, on every rank."""
        box = [value if self.writer else None]
        dist.broadcast_object_list(box, src=0, group=self._group)
        return box[0]


class SGLangCapture:
    """Same interface as `hidden.HFCapture`: called with a batch of token ID lists, returns
    per sample (aux [T, A*H], final [T, H]) on the writer rank (an empty list elsewhere)."""

    packed = True  # SGLang extends a batch as one flat sequence: budget tokens, not rows x longest

    def __init__(self, runner, aux_spec, final: str, ranks=None):
        self.runner = runner
        self.ranks = ranks if ranks is not None else TensorParallelRanks()
        config = runner.hf_config
        self.num_layers = config.num_hidden_layers
        self.hidden_size = config.hidden_size
        self.aux_layers = resolve_aux_layers(self.num_layers, aux_spec)
        self.final = final
        self.model_name = runner.model_name
        self._captured: dict[str, object] = {}
        self._hook_model(runner.model)

    def _hook_model(self, model: torch.nn.Module) -> None:
        # SGLang names a capture by the decoder layer whose input it is: id k yields the
        # output of layer k+1, i.e. hidden_states index k+1.
        model.set_eagle3_layers_to_capture([i - 1 for i in self.aux_layers])
        stack = _decoder_stack(model)
        if list(stack.layers_to_capture) != list(self.aux_layers):
            raise RuntimeError(
                f"SGLang captures layer inputs {list(stack.layers_to_capture)} for requested hidden_states "
                f"indices {self.aux_layers}: this SGLang release numbers capture layers differently from the "
                "one pinned in envs/sglang.yaml; run scripts/gpu_check.py before trusting its states"
            )
        model.logits_processor.register_forward_pre_hook(self._keep_logits_inputs, with_kwargs=True)
        if self.final == "raw":
            stack.norm.register_forward_pre_hook(self._keep_raw_final)

    def _keep_logits_inputs(self, _module, args, kwargs):
        # SGLang models call logits_processor(input_ids, hidden_states, lm_head, forward_batch, aux_hidden_states).
        self._captured["normed"] = args[1] if len(args) > 1 else kwargs["hidden_states"]
        self._captured["aux"] = args[4] if len(args) > 4 else kwargs.get("aux_hidden_states")

    def _keep_raw_final(self, _module, args):
        # The fused add-norm overwrites its inputs in place: keep their sum before it runs.
        x, residual = args[0], (args[1] if len(args) > 1 else None)
        self._captured["raw"] = x.clone() if residual is None else x + residual

    @torch.inference_mode()
    def __call__(self, batch: list[list[int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        self._captured.clear()
        self.runner.extend(batch)
        if not self.ranks.writer:
            return []
        aux = self._captured.get("aux")
        if not aux or len(aux) != len(self.aux_layers):
            raise RuntimeError(
                f"SGLang handed {0 if not aux else len(aux)} auxiliary states to the logits processor, "
                f"expected {len(self.aux_layers)}: the model class may not support EAGLE-3 capture"
            )
        aux = torch.cat(list(aux), dim=-1)
        final = self._captured["raw" if self.final == "raw" else "normed"]
        lengths = [len(ids) for ids in batch]
        if aux.shape[0] != sum(lengths) or final.shape[0] != sum(lengths):
            raise RuntimeError(
                f"SGLang returned states for {aux.shape[0]} tokens, the batch has {sum(lengths)}: "
                "prefix caching or chunked prefill must be off"
            )
        return list(zip(aux.cpu().split(lengths), final.cpu().split(lengths), strict=True))


def _decoder_stack(model: torch.nn.Module) -> torch.nn.Module:
    """The module that owns the decoder layers, the capture list and the final norm."""
    for module in model.modules():
        if hasattr(module, "layers_to_capture") and hasattr(module, "norm"):
            return module
    raise RuntimeError(f"{type(model).__name__}: no decoder stack with EAGLE-3 capture support found")


class SGLangModelRunner:
    """SGLang's ModelRunner for one rank, loaded for prefill-only capture.

    Written against the release pinned in envs/sglang.yaml (the same calls SpecForge's offline
    capture makes); everything it returns is checked by `SGLangCapture` and scripts/gpu_check.py.
    """

    def __init__(self, model_path: str | Path, settings: dict, trust_remote_code: bool, max_batch_tokens: int):
        from sglang.srt.configs.model_config import ModelConfig
        from sglang.srt.model_executor.model_runner import ModelRunner
        from sglang.srt.server_args import ServerArgs

        rank, world_size = dist.get_rank(), dist.get_world_size()
        local_rank = torch.cuda.current_device()  # set by join_torchrun
        self.server_args = ServerArgs(
            model_path=str(model_path),
            trust_remote_code=trust_remote_code,
            dtype=settings.get("dtype", "auto"),
            tp_size=world_size,
            mem_fraction_static=settings.get("mem_fraction_static", 0.85),
            disable_radix_cache=True,
            chunked_prefill_size=-1,
            disable_cuda_graph=True,
            max_prefill_tokens=max_batch_tokens,
            **settings.get("server_args", {}),
        )
        model_config = ModelConfig.from_server_args(self.server_args)
        self.runner = ModelRunner(
            model_config=model_config,
            mem_fraction_static=self.server_args.mem_fraction_static,
            gpu_id=local_rank,
            tp_rank=rank,
            tp_size=world_size,
            moe_ep_rank=rank // (world_size // self.server_args.ep_size),
            moe_ep_size=self.server_args.ep_size,
            pp_rank=0,
            pp_size=1,
            nccl_port=None,  # torch.distributed is already initialised by torchrun
            server_args=self.server_args,
        )
        if self.runner.max_total_num_tokens < max_batch_tokens:
            raise ValueError(
                f"the KV cache holds {self.runner.max_total_num_tokens} tokens, below "
                f"hidden_states.max_batch_tokens={max_batch_tokens}; lower it or raise "
                "hidden_states.sglang.mem_fraction_static"
            )
        self.model = self.runner.model
        self.hf_config = model_config.hf_text_config
        self.model_name = Path(model_path).name

    def extend(self, batch: Sequence[Sequence[int]]) -> None:
        """One packed prefill of `batch`; captured states reach the hooks `SGLangCapture` set."""
        from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.radix_cache import RadixCache
        from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch
        from sglang.srt.sampling.sampling_params import SamplingParams
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        runner = self.runner
        params = SamplingParams(temperature=0, max_new_tokens=1)
        reqs = []
        for number, ids in enumerate(batch):
            req = Req(rid=str(number), origin_input_text="", origin_input_ids=list(ids), sampling_params=params)
            req.fill_ids = req.origin_input_ids
            req.extend_input_len = len(req.fill_ids)
            req.logprob_start_len = len(req.origin_input_ids) - 1
            reqs.append(req)
        no_cache = RadixCache(
            CacheInitParams(
                disable=True,
                req_to_token_pool=runner.req_to_token_pool,
                token_to_kv_pool_allocator=runner.token_to_kv_pool_allocator,
                page_size=self.server_args.page_size,
            )
        )
        schedule = ScheduleBatch.init_new(
            reqs=reqs,
            req_to_token_pool=runner.req_to_token_pool,
            token_to_kv_pool_allocator=runner.token_to_kv_pool_allocator,
            tree_cache=no_cache,
            model_config=runner.model_config,
            enable_overlap=False,
            spec_algorithm=SpeculativeAlgorithm.NONE,
        )
        schedule.prepare_for_extend()
        forward_batch = ForwardBatch.init_new(schedule.get_model_worker_batch(), runner)
        forward_batch.capture_hidden_mode = CaptureHiddenMode.FULL
        try:
            runner.forward(forward_batch)
        finally:
            runner.req_to_token_pool.clear()
            runner.token_to_kv_pool_allocator.clear()


def join_torchrun() -> None:
    """Join the process group torchrun set up: one rank per GPU, NCCL, rank 0 alone logging progress."""
    if "RANK" not in os.environ:
        raise RuntimeError(
            "hidden_states.backend: sglang runs one process per GPU: start it with "
            "`torchrun --nproc-per-node <GPUs> scripts/hidden_states.py ...` (the workflow's rule does)"
        )
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl")
    if dist.get_rank() != 0:
        logging.getLogger("eagle3_datagen").setLevel(logging.WARNING)


def load_sglang_capture(
    model_path: str | Path, aux_spec, final: str, settings: dict, trust_remote_code: bool, max_batch_tokens: int
) -> SGLangCapture:
    """Join the torchrun process group and load this rank's slice of the model."""
    join_torchrun()
    runner = SGLangModelRunner(model_path, settings, trust_remote_code, max_batch_tokens)
    return SGLangCapture(runner, aux_spec, final)
