"""On-disk formats shared by the stages: atomic files and JSONL, raw dataset layouts, the
responses journal, histograms, hidden-state shards and their codec, model directories."""
