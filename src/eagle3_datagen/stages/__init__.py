"""The workflow's stages, in flow order: prompts, responses, tokens, hidden, probe, vocab, export, evaluate.
Each is called by its script in `scripts/`; no stage imports another."""
