"""The target families' architectures in SGLang 0.5.23 on the CPU: the auxiliary-layer ids each family's
registry entry writes into a draft config (`Family.sglang_layer_ids`) make SGLang's own
`set_eagle3_layers_to_capture` capture the layers the draft was trained on, for every family's
architecture, gpt-oss's included (its model runner does not run here: test_capture.py says why and
captures the others)."""

import importlib
from types import SimpleNamespace

import pytest

from eagle3_datagen.chat.families.target_chat import family_for_model_type

ARCHITECTURES = [
    ("sglang.srt.models.qwen3", "Qwen3ForCausalLM", "qwen3"),
    ("sglang.srt.models.qwen3_moe", "Qwen3MoeForCausalLM", "qwen3_moe"),
    ("sglang.srt.models.llama", "LlamaForCausalLM", "llama"),
    ("sglang.srt.models.gpt_oss", "GptOssForCausalLM", "gpt_oss"),
    ("sglang.srt.models.deepseek_v2", "DeepseekV3ForCausalLM", "deepseek_v3"),
]


class DecoderStack:
    """Where SGLang's causal-LM classes leave the capture list (Qwen3-MoE's sets it through a method)."""

    layers_to_capture: list[int] = []

    def set_eagle3_layers_to_capture(self, layers: list[int]) -> None:
        self.layers_to_capture = list(layers)


@pytest.mark.parametrize(("module", "cls", "model_type"), ARCHITECTURES)
@pytest.mark.parametrize("aux_layers", [[2, 4, 5], [3, 5, 6], [4, 5, 6]])
def test_a_familys_draft_layer_ids_make_sglang_capture_its_layers(module, cls, model_type, aux_layers):
    """SGLang's own method, called on a stand-in for the model object (a real one needs a model runner per
    process, which the capture tests build for Qwen3 and DeepSeek-V3): it sets the decoder stack's inputs to
    capture, which are hidden_states indices."""
    model = SimpleNamespace(
        pp_group=SimpleNamespace(is_last_rank=True), config=SimpleNamespace(num_hidden_layers=8), model=DecoderStack()
    )
    ids = family_for_model_type(model_type).sglang_layer_ids(aux_layers)
    getattr(importlib.import_module(module), cls).set_eagle3_layers_to_capture(model, ids)
    assert model.model.layers_to_capture == aux_layers, (model_type, ids)
