"""The trainer exports by name (`export.formats`): each exporter class registers itself where it is
defined (`@EXPORTS.register(name)`), and is built from the shards, the target model's directory, the draft
vocabulary and its own section of the `export` settings (`export.<name>`, {} where it has none)."""

from __future__ import annotations

from eagle3_datagen.registry import Registry

EXPORTS: Registry = Registry("export")
