"""The vLLM backends: its OpenAI-compatible server for generation, its `extract_hidden_states` method for capture."""
