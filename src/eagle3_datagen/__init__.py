"""eagle3-datagen: raw chat datasets -> EAGLE-3 draft-model training data for a target model.

Data flows one way, and imports point the same way, down: `stages` (prompts -> responses ->
tokens -> hidden -> probe, vocab, export -> evaluate) use `backends` (generation and capture), which use the
shared pieces: `chat` (template, tokenizers, tool calls) and `formats` (files, datasets, shards).
`targets` build the demo models, `reporting` plans and summarises runs, `workflow` serves
`rules/common.smk`, `diagnostics` checks a GPU node. Nothing imports a stage but its script."""
