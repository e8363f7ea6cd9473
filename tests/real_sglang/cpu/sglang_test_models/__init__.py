"""The model classes the CPU tests load (Qwen3, Qwen3-MoE, Llama, DeepSeek-V3), registered alone
(SGLANG_EXTERNAL_MODEL_PACKAGE): importing all of SGLang's model files takes a minute on a CI core. gpt-oss's
is only imported, for its layer numbering: its model runner needs an attention backend with sinks that has
no CPU build on PyPI."""
