from sglang.srt.models.deepseek_common.attention_backend_handler import (
    AttentionBackendRegistry,
    _dispatch_mla_subtype,
)
from sglang.srt.models.deepseek_v2 import EntryClass  # noqa: F401

# torch_native has no MLA handler: SGLang falls back to triton's, whose prefill takes the MHA path
# that torch_native cannot run on MLA shapes. Route it to SGLang's own absorbed-MLA path instead.
AttentionBackendRegistry.register("torch_native", _dispatch_mla_subtype)
