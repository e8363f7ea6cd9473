"""The calls this project makes into SGLang exist, with the parameters it passes, in the installed
release: a version bump that moves one fails here, on a CPU, before a GPU node is booked."""

import argparse
import inspect

import pytest

from eagle3_datagen.backends.sglang.capture import CPU_SERVER_FLAGS, server_flags
from eagle3_datagen.config_schema import fill_defaults
from tests.helpers.sglang_cpu import CPU_LAUNCH_ARGS


def takes(function, *names):
    parameters = inspect.signature(function).parameters
    missing = [n for n in names if n not in parameters]
    assert not missing, f"{function.__qualname__}{inspect.signature(function)} lacks {missing}"


def test_the_runner_is_built_with_calls_the_release_has():
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.distributed import bootstrap
    from sglang.srt.layers.moe import initialize_moe_config
    from sglang.srt.layers.quantization.fp4_utils import initialize_fp4_gemm_config
    from sglang.srt.layers.quantization.fp8_utils import initialize_fp8_gemm_config
    from sglang.srt.layers.quantization.unquant import initialize_bf16_gemm_config
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.runtime_context import SpawnRanks, get_device, get_schedule, publish, spawn_world_rank
    from sglang.srt.server_args import PortArgs, ServerArgs

    takes(publish, "server_args", "role", "ranks")
    takes(SpawnRanks, "world_rank", "gpu_id")
    takes(spawn_world_rank, "server_args", "tp_rank", "pp_rank")
    takes(bootstrap.init_parallel_runtime, "server_args", "device", "dist_port")
    takes(bootstrap.init_layer_runtime, "model_config")
    takes(ModelConfig.from_server_args, "server_args")
    takes(PortArgs.init_new, "server_args")
    takes(ModelRunner.__init__, "model_config", "mem_fraction_static", "gpu_id", "nccl_port", "server_args")
    for method in ("alloc_memory_pool", "init_attention_backends", "init_cuda_graphs", "forward"):
        assert callable(getattr(ModelRunner, method)), method
    for function in (initialize_moe_config, initialize_fp8_gemm_config, initialize_bf16_gemm_config):
        assert not inspect.signature(function).parameters
    assert not inspect.signature(initialize_fp4_gemm_config).parameters
    assert callable(get_device) and callable(get_schedule) and callable(ServerArgs.resolve_once)


def test_an_extend_is_made_with_calls_the_release_has():
    from sglang.srt.layers.aux_hidden_states import pack_aux_hidden_states
    from sglang.srt.layers.logits_processor import LogitsProcessor
    from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch
    from sglang.srt.sampling.sampling_params import SamplingParams
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    takes(Req.__init__, "rid", "origin_input_text", "origin_input_ids", "sampling_params")
    takes(
        ScheduleBatch.init_new,
        *("reqs", "req_to_token_pool", "token_to_kv_pool_allocator", "tree_cache", "model_config"),
        *("enable_overlap", "spec_algorithm"),
    )
    assert callable(ScheduleBatch.prepare_for_extend)
    takes(ForwardBatch.init_new, "batch", "model_runner", "capture_hidden_mode", "return_hidden_states_before_norm")
    takes(SamplingParams, "temperature", "max_new_tokens")
    assert CaptureHiddenMode.FULL and SpeculativeAlgorithm.NONE is not None
    # SGLangCapture's pre-hook reads these positions.
    assert list(inspect.signature(LogitsProcessor.forward).parameters)[1:6] == [
        "input_ids",
        "hidden_states",
        "lm_head",
        "logits_metadata",
        "aux_hidden_states",
    ]
    takes(pack_aux_hidden_states, "aux_hidden_states")


@pytest.mark.parametrize(
    ("module", "cls"),
    [
        ("sglang.srt.models.qwen3", "Qwen3ForCausalLM"),
        ("sglang.srt.models.deepseek_v2", "DeepseekV3ForCausalLM"),
        ("sglang.srt.models.kimi_k25", "KimiK25ForConditionalGeneration"),
    ],
)
def test_the_model_families_take_eagle3_capture_layers(module, cls):
    import importlib

    takes(getattr(importlib.import_module(module), cls).set_eagle3_layers_to_capture, "layer_ids")


def test_the_server_flags_used_parse():
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    settings = fill_defaults(
        {"dtype": "float32", "server_args": {"max_total_tokens": 4096, "trust_remote_code": True}},
        "hidden_states.sglang",
    )
    flags = [*server_flags("/m", settings, False, 64, 2), *CPU_SERVER_FLAGS]
    args = parser.parse_args(flags)
    assert (args.tp_size, args.chunked_prefill_size, args.max_total_tokens, args.trust_remote_code) == (
        2,
        -1,
        4096,
        True,
    )
    parser.parse_args(["--model-path", "/m", *CPU_LAUNCH_ARGS])


def test_the_http_routes_used_exist():
    from sglang.srt.entrypoints.http_server import app

    paths = {route.path for route in app.routes if hasattr(route, "path")}  # not the included routers
    assert {"/generate", "/health", "/model_info"} <= paths
