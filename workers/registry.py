"""Classes chosen by name: one ``Registry`` per extension point (KV connectors, grammar backends,
routing policies), so adding an implementation is one new module and one decorator."""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T", bound=type)


class Registry(Generic[T]):
    """Maps ``cls.name`` to ``cls``. ``load_builtins`` imports the built-in implementations (their
    modules import the registry's, so they cannot be imported at its top) before any lookup."""

    def __init__(self, what: str, load_builtins: Callable[[], None] | None = None) -> None:
        self.what = what
        self._load = load_builtins
        self._classes: dict[str, T] = {}

    def register(self, cls: T) -> T:
        """Class decorator: make ``cls`` available under ``cls.name``."""
        name = getattr(cls, "name", "")
        if not name or name in self._classes:
            raise ValueError(f"{self.what} name {name!r} is empty or taken")
        self._classes[name] = cls
        return cls

    def names(self) -> list[str]:
        """The registered names, sorted."""
        self._builtins()
        return sorted(self._classes)

    def get(self, name: str) -> T:
        """The class registered as ``name``; ValueError listing the known names otherwise."""
        self._builtins()
        try:
            return self._classes[name]
        except KeyError:
            raise ValueError(f"unknown {self.what} {name!r}; known: {', '.join(sorted(self._classes))}") from None

    def _builtins(self) -> None:
        if self._load is not None:
            load, self._load = self._load, None
            load()
