"""Where usage records go: the ``UsageStore`` contract and a registry of writers by name, so a
platform team adds a writer with one new module and one ``register_usage_store`` call."""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import Any, ClassVar

from baton_serve.cluster.usage.record import UsageRecord
from baton_serve.workers.registry import Registry


class UsageStoreClosed(RuntimeError):
    """``record()`` was called on a store after ``close()``."""


class UsageStore(abc.ABC):
    """An append-only store of usage records, at most one per ``request_id``: the first wins."""

    @abc.abstractmethod
    def record(self, rec: UsageRecord) -> None:
        """Queue ``rec`` and return; never does disk I/O, so it may be called on an event loop.
        Raises ``UsageStoreClosed`` after ``close()``."""

    @abc.abstractmethod
    def flush(self, timeout_s: float = 10.0) -> None:
        """Block until every record given so far is durable; ``TimeoutError`` if not within ``timeout_s``."""

    @abc.abstractmethod
    def close(self) -> None:
        """Flush, then stop the writer. Idempotent; later ``record()`` calls raise ``UsageStoreClosed``."""

    @abc.abstractmethod
    def count(self) -> int:
        """How many records are stored (durable ones only)."""

    @abc.abstractmethod
    def records(self, limit: int | None = None) -> list[UsageRecord]:
        """The stored records, oldest first, at most ``limit`` of them."""

    @property
    @abc.abstractmethod
    def duplicates(self) -> int:
        """Records refused since this store opened because their ``request_id`` was already stored."""

    def __enter__(self) -> UsageStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


UsageStoreFactory = Callable[..., UsageStore]


def _load_builtins() -> None:
    # Importing registers them; here rather than at the top, as they import this module.
    from baton_serve.cluster.usage import sqlite_store  # noqa: F401


class _Entry:
    # ``Registry`` keys classes by their ``name``; each registration is a one-off subclass of this
    # holder, so a plain function can be a factory as well as a store class.
    name: ClassVar[str] = ""
    factory: ClassVar[UsageStoreFactory]


_REGISTRY: Registry[type[_Entry]] = Registry("usage store", _load_builtins)


def register_usage_store(name: str, factory: UsageStoreFactory) -> UsageStoreFactory:
    """Make ``factory(**options)`` available as ``make_usage_store(name, **options)``; returns ``factory``.
    ValueError if ``name`` is empty or taken."""
    _REGISTRY.register(
        type(f"UsageStoreEntry[{name}]", (_Entry,), {"name": name, "factory": staticmethod(factory)})
    )
    return factory


def usage_store_names() -> list[str]:
    """The registered usage store names, sorted."""
    return _REGISTRY.names()


def make_usage_store(name: str, **options: Any) -> UsageStore:
    """The store registered as ``name``, built with ``options``; ValueError naming the known ones."""
    return _REGISTRY.get(name).factory(**options)
