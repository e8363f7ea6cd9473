"""The `sglang` hidden-state backend: SGLang's in-process model runner, tensor parallel.

One process per GPU (`torchrun --nproc-per-node {tp} scripts/hidden_states.py ...`). Every rank
runs the same plan in lockstep, because each forward pass is a collective; rank 0 decides which
parts an earlier run already finished, broadcasts that decision, and alone writes files.

States are taken where SGLang's own EAGLE-3 support takes them, so they match what a draft model
sees when served: the auxiliary layers through `set_eagle3_layers_to_capture` (handed to the
logits processor, as a list or one packed [T, K*H] tensor depending on the model family), the
normed final state as the logits processor's input, and the raw layer-N output as the final
norm's `x + residual`. Extend batches are packed (no padding); prefix caching, chunked prefill
and CUDA graphs are off so every state is computed in full for every token.

Only `SGLangModelRunner` touches SGLang's internals (ServerArgs, the runtime context, ModelRunner,
ScheduleBatch, ForwardBatch), built in the order SGLang 0.5.23's own `benchmark/one_batch.py`
builds them; envs/sglang.yaml pins that release, tests/real_sglang/test_contract.py fails when
an installed release lacks a call made here, and `scripts/gpu_check.py` compares this backend
with `hf` layer by layer on a GPU.
"""

from __future__ import annotations

import argparse
import logging
import os
from array import array
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist

from eagle3_datagen.formats.hidden_shard import resolve_aux_layers

# SGLang on a CPU (tests, gpu_check's CPU run): its portable kernels only.
CPU_SERVER_FLAGS = (
    "--device",
    "cpu",
    "--attention-backend",
    "torch_native",
    "--sampling-backend",
    "pytorch",
    "--grammar-backend",
    "none",
)


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
    """A `base.CaptureBackend`, as `hf.capture.HFCapture` is: called with a batch of token ID lists, returns
    per sample (aux [T, A*H], final [T, H]) on the writer rank (an empty list elsewhere)."""

    packed = True  # SGLang extends a batch as one flat sequence: budget tokens, not rows x longest

    def __init__(self, runner, aux_spec, final: str, ranks=None):
        self.runner = runner
        self.model = runner.model
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
        stack = _decoder_stack(model)
        _set_capture_layers(model, stack, self.aux_layers)
        _logits_processor(model).register_forward_pre_hook(self._keep_logits_inputs, with_kwargs=True)
        if self.final == "raw":
            stack.norm.register_forward_pre_hook(self._keep_raw_final)

    def _keep_logits_inputs(self, _module, args, kwargs):
        # SGLang models call logits_processor(input_ids, hidden_states, lm_head, forward_batch, aux_hidden_states).
        self._captured["normed"] = args[1] if len(args) > 1 else kwargs["hidden_states"]
        self._captured["aux"] = args[4] if len(args) > 4 else kwargs.get("aux_hidden_states")

    def _keep_raw_final(self, _module, args):
        # A fused add-norm may overwrite its inputs in place: keep their sum before it runs.
        x, residual = args[0], (args[1] if len(args) > 1 else None)
        self._captured["raw"] = x.clone() if residual is None else x + residual

    @torch.inference_mode()
    def __call__(self, batch: list[list[int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        from sglang.srt.layers.aux_hidden_states import pack_aux_hidden_states

        self._captured.clear()
        self.runner.extend(batch)
        if not self.ranks.writer:
            return []
        aux = self._captured.get("aux")
        if aux is None or len(aux) == 0:
            raise RuntimeError(
                "SGLang handed no auxiliary states to the logits processor: the model class may not "
                "support EAGLE-3 capture"
            )
        # Qwen-style models hand over a list of K [T, H] tensors, DeepSeek-style ones one [T, K*H].
        aux = pack_aux_hidden_states(aux)
        final = self._captured["raw" if self.final == "raw" else "normed"]
        lengths = [len(ids) for ids in batch]
        if aux.shape[0] != sum(lengths) or final.shape[0] != sum(lengths):
            raise RuntimeError(
                f"SGLang returned states for {aux.shape[0]} tokens, the batch has {sum(lengths)}: "
                "prefix caching or chunked prefill must be off"
            )
        if aux.shape[1] != len(self.aux_layers) * self.hidden_size:
            raise RuntimeError(
                f"SGLang handed over auxiliary states {aux.shape[1]} wide, expected "
                f"{len(self.aux_layers)} layers x {self.hidden_size}"
            )
        return list(zip(aux.cpu().split(lengths), final.cpu().split(lengths), strict=True))


def _decoder_stack(model: torch.nn.Module) -> torch.nn.Module:
    """The module that owns the decoder layers, the capture list and the final norm."""
    for module in model.modules():
        if hasattr(module, "layers_to_capture") and hasattr(module, "norm"):
            return module
    raise RuntimeError(f"{type(model).__name__}: no decoder stack with EAGLE-3 capture support found")


def _logits_processor(model: torch.nn.Module) -> torch.nn.Module:
    """The logits processor, on the model or a wrapped language model (Kimi-K2.5: `.language_model`)."""
    from sglang.srt.layers.logits_processor import LogitsProcessor

    found = [m for m in model.modules() if isinstance(m, LogitsProcessor)]
    if len(found) != 1:
        raise RuntimeError(f"{type(model).__name__}: expected one LogitsProcessor, found {len(found)}")
    return found[0]


def _set_capture_layers(model: torch.nn.Module, stack: torch.nn.Module, aux_layers: Sequence[int]) -> None:
    """Make SGLang capture hidden_states[i] for each i in `aux_layers`, and check that it will.

    The decoder stack captures the input of layer i (0-based) for each i in `layers_to_capture`,
    i.e. hidden_states index i. Model families map the ids handed to
    `set_eagle3_layers_to_capture` differently: Qwen/Llama add 1 to every id; DeepSeek V2/V3
    (Kimi) add 1 only when the first id is 1 and otherwise take the ids as they are. Both
    conventions are tried, and the list SGLang will actually use is read back.
    """
    wanted = list(aux_layers)
    for ids in ([i - 1 for i in wanted], wanted):
        model.set_eagle3_layers_to_capture(ids)
        if list(stack.layers_to_capture) == wanted:
            return
    raise RuntimeError(
        f"{type(model).__name__} captures decoder-layer inputs {list(stack.layers_to_capture)} for requested "
        f"hidden_states indices {wanted}: this SGLang release numbers capture layers differently from the one "
        "pinned in envs/sglang.yaml; run scripts/gpu_check.py before trusting its states"
    )


def server_flags(
    model_path: str | Path, settings: dict, trust_remote_code: bool, max_batch_tokens: int, tp_size: int
) -> list[str]:
    """`launch_server` flags for prefill-only capture: every token of every sample computed."""
    flags = [
        "--model-path",
        str(model_path),
        "--dtype",
        settings["dtype"],
        "--tp-size",
        str(tp_size),
        "--mem-fraction-static",
        str(settings["mem_fraction_static"]),
        "--max-prefill-tokens",
        str(max_batch_tokens),
        "--chunked-prefill-size",
        "-1",
        "--disable-radix-cache",
        "--cuda-graph-backend-decode",
        "disabled",
        "--cuda-graph-backend-prefill",
        "disabled",
    ]
    if trust_remote_code:
        flags.append("--trust-remote-code")
    for name, value in settings["server_args"].items():
        flag = "--" + name.replace("_", "-")
        if value is True:
            flags.append(flag)
        elif value is not False and value is not None:
            flags += [flag, str(value)]
    return flags


class SGLangModelRunner:
    """SGLang's ModelRunner for one rank, loaded for prefill-only capture.

    Built as SGLang 0.5.23's `benchmark/one_batch.py` builds one: publish the resolved server
    args with this process's ranks, the process-wide kernel configs, the parallel runtime (which
    joins a torch.distributed already set up by torchrun), the layer runtime, the runner, its
    memory pool and attention backends.
    """

    def __init__(self, flags: Sequence[str], rank: int = 0, gpu_id: int = 0):
        from sglang.srt.configs.model_config import ModelConfig
        from sglang.srt.distributed import bootstrap
        from sglang.srt.layers.moe import initialize_moe_config
        from sglang.srt.layers.quantization.fp4_utils import initialize_fp4_gemm_config
        from sglang.srt.layers.quantization.fp8_utils import initialize_fp8_gemm_config
        from sglang.srt.layers.quantization.unquant import initialize_bf16_gemm_config
        from sglang.srt.model_executor.model_runner import ModelRunner
        from sglang.srt.runtime_context import SpawnRanks, get_device, get_schedule, publish, spawn_world_rank
        from sglang.srt.server_args import PortArgs, ServerArgs

        parser = argparse.ArgumentParser()
        ServerArgs.add_cli_args(parser)
        self.server_args = ServerArgs.from_cli_args(parser.parse_args(list(flags)))
        self.server_args.resolve_once()
        publish(
            self.server_args,
            role="scheduler",
            ranks=SpawnRanks(
                world_rank=spawn_world_rank(self.server_args, tp_rank=rank, pp_rank=0),
                gpu_id=gpu_id,
            ),
        )
        initialize_moe_config()
        initialize_fp8_gemm_config()
        initialize_bf16_gemm_config()
        initialize_fp4_gemm_config()
        model_config = ModelConfig.from_server_args(self.server_args)
        nccl_port = PortArgs.init_new(self.server_args).nccl_port  # unused when torchrun set up torch.distributed
        bootstrap.init_parallel_runtime(server_args=self.server_args, device=get_device().device, dist_port=nccl_port)
        bootstrap.init_layer_runtime(model_config=model_config)
        self.runner = ModelRunner(
            model_config=model_config,
            mem_fraction_static=get_schedule().mem_fraction_static,
            gpu_id=gpu_id,
            nccl_port=nccl_port,
            server_args=self.server_args,
        )
        self.runner.alloc_memory_pool()
        self.runner.init_attention_backends()
        self.runner.init_cuda_graphs()  # with CUDA graphs off: the eager runners forward() expects
        self.page_size = get_schedule().page_size
        self.max_prefill_tokens = get_schedule().max_prefill_tokens
        if self.runner.max_total_num_tokens < self.max_prefill_tokens:
            raise ValueError(
                f"the KV cache holds {self.runner.max_total_num_tokens} tokens, below "
                f"hidden_states.max_batch_tokens={self.max_prefill_tokens}; lower it or raise "
                "hidden_states.sglang.mem_fraction_static"
            )
        self.model = self.runner.model
        self.hf_config = model_config.hf_text_config
        self.model_name = Path(model_config.model_path).name

    @torch.inference_mode()
    def extend(self, batch: Sequence[Sequence[int]]) -> None:
        """One packed prefill of `batch`; captured states reach the hooks `SGLangCapture` set."""
        from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
        from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch
        from sglang.srt.sampling.sampling_params import SamplingParams
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        runner = self.runner
        params = SamplingParams(temperature=0, max_new_tokens=1)
        reqs = []
        for number, ids in enumerate(batch):
            req = Req(rid=str(number), origin_input_text="", origin_input_ids=array("q", ids), sampling_params=params)
            req.full_untruncated_fill_ids = req.origin_input_ids
            req.logprob_start_len = -1
            req.extend_end = len(req.origin_input_ids)
            reqs.append(req)
        schedule = ScheduleBatch.init_new(
            reqs=reqs,
            req_to_token_pool=runner.req_to_token_pool,
            token_to_kv_pool_allocator=runner.token_to_kv_pool_allocator,
            tree_cache=_NoPrefixCache(
                page_size=self.page_size,
                device=runner.device,
                token_to_kv_pool_allocator=runner.token_to_kv_pool_allocator,
            ),
            model_config=runner.model_config,
            enable_overlap=False,
            spec_algorithm=SpeculativeAlgorithm.NONE,
        )
        schedule.prepare_for_extend()
        if schedule.input_ids is None and getattr(schedule, "prefill_input_ids_cpu", None) is not None:
            schedule.input_ids = schedule.prefill_input_ids_cpu.to(schedule.device, non_blocking=True)
            schedule.prefill_input_ids_cpu = None
        forward_batch = ForwardBatch.init_new(
            schedule,
            runner,
            capture_hidden_mode=CaptureHiddenMode.FULL,
            return_hidden_states_before_norm=False,
        )
        try:
            runner.forward(forward_batch)
        finally:
            runner.req_to_token_pool.clear()
            runner.token_to_kv_pool_allocator.clear()


class _NoPrefixCache(SimpleNamespace):
    """The tree cache `ScheduleBatch` allocates through, with nothing cached (as one_batch.py's)."""

    def supports_swa(self) -> bool:
        return False

    def supports_mamba(self) -> bool:
        return False

    def supports_prefix_sharing(self) -> bool:
        return True

    def evict(self, params) -> None:
        pass

    def maybe_hand_to_session(self, req) -> None:
        pass


def join_torchrun(device: str = "cuda") -> tuple[int, int]:
    """Join the process group torchrun set up (one rank per GPU, rank 0 alone logging progress);
    returns (rank, local device index)."""
    if "RANK" not in os.environ:
        raise RuntimeError(
            "hidden_states.backend: sglang runs one process per GPU: start it with "
            "`torchrun --nproc-per-node <GPUs> scripts/hidden_states.py ...` (the workflow's rule does)"
        )
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if device == "cuda":
        torch.cuda.set_device(local_rank)
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device == "cuda" else "gloo")
    if dist.get_rank() != 0:
        logging.getLogger("eagle3_datagen").setLevel(logging.WARNING)
    return dist.get_rank(), local_rank


def load_sglang_capture(
    model_path: str | Path, aux_spec, final: str, settings: dict, trust_remote_code: bool, max_batch_tokens: int
) -> SGLangCapture:
    """Join the torchrun process group and load this rank's slice of the model."""
    device = settings["device"]
    if device == "cpu":
        os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")  # read when sglang is first imported
    rank, local_rank = join_torchrun(device)
    flags = server_flags(model_path, settings, trust_remote_code, max_batch_tokens, dist.get_world_size())
    if device == "cpu":
        flags += CPU_SERVER_FLAGS
    runner = SGLangModelRunner(flags, rank=rank, gpu_id=local_rank)
    return SGLangCapture(runner, aux_spec, final)


def capture_for_job(hidden: dict, model: dict) -> SGLangCapture:
    """The capture the `hidden_states` and `model` settings configure (plugins.CaptureBackend)."""
    return load_sglang_capture(
        model["path"],
        hidden["aux_layers"],
        hidden["final"],
        hidden["sglang"],
        model["trust_remote_code"],
        hidden["max_batch_tokens"],
    )
