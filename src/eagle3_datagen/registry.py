"""Plug-ins by name: one `Registry` per axis (target families, generation and capture backends, trainer
exports, dataset layouts).

An entry is registered where it is defined, the way speculators registers its draft models and
hidden-state backends (`ClassRegistryMixin`): code, configs and tests read the names from the registry
instead of repeating them. The registry holds whatever its axis registers (a class, an object) and knows
nothing of what an entry means; it imports nothing of the package. An entry that the workflow reads
without its dependencies names its implementation as `module:name` (`import_implementation`).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class UnknownEntry(KeyError):
    """A name that no entry of the registry has; the message lists the names there are."""

    def __str__(self) -> str:
        return str(self.args[0])


class Registry(Generic[T]):
    """Entries of one kind by name, in the order they registered."""

    def __init__(self, kind: str):
        self.kind = kind
        self._entries: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        """A decorator that adds the decorated class or object under `name` and returns it unchanged."""

        def add(entry: T) -> T:
            if name in self._entries:
                raise ValueError(f"{self.kind} {name!r} is registered twice: {self._entries[name]!r} and {entry!r}")
            self._entries[name] = entry
            return entry

        return add

    def __getitem__(self, name: str) -> T:
        try:
            return self._entries[name]
        except KeyError:
            raise UnknownEntry(f"unknown {self.kind} {name!r}; registered: {', '.join(self._entries)}") from None

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def names(self) -> list[str]:
        return list(self._entries)

    def values(self) -> list[T]:
        return list(self._entries.values())

    def items(self) -> list[tuple[str, T]]:
        return list(self._entries.items())


def import_implementation(path: str):
    """The callable at `module:name` (`name` may be dotted: a class's method) that an entry names, imported
    when a job first uses it: an entry is read without importing its implementation's dependencies."""
    module, name = path.split(":")
    found = importlib.import_module(module)
    for part in name.split("."):
        found = getattr(found, part)
    return found
