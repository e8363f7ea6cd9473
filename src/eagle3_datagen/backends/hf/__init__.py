"""In-process transformers: generation (`generate`), capture (`capture`), model loading."""
