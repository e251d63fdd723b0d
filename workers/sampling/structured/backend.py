"""Grammar backends, chosen by name: compile a ``StructuredSpec`` for one tokenizer, hand out matchers.

Contract (every backend):

- ``GrammarBackend(tokenizer_json, vocab_size, eos_token_ids)``: ``vocab_size`` is the model's
  logits width, which may exceed the tokenizer's vocabulary (padded embeddings); ids the tokenizer
  does not have are never allowed. ``eos_token_ids`` are the ids that end a sequence: allowed
  exactly when the output so far is complete under the grammar.
- ``compile(spec, param)``: thread-safe; cached by ``spec.key`` in a bounded LRU. A constraint that
  cannot be compiled (bad schema, regex or grammar; a JSON-schema feature the backend lacks) raises
  ``InvalidRequestError(reason, param=param)``, and nothing is cached.
- ``matcher(compiled)``: a fresh ``GrammarMatcher`` at the grammar's start; cheap (no compiling).
- A ``GrammarMatcher`` is one sequence's state, used by one thread at a time; ``copy`` forks it.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from baton_serve.workers.registry import Registry
from baton_serve.workers.sampling.structured.spec import DEFAULT_PARAM, StructuredSpec

DEFAULT_BACKEND = "llguidance"
DEFAULT_CACHE_SIZE = 256


@dataclass(frozen=True, eq=False)
class CompiledGrammar:
    """A spec compiled by one backend instance; ``payload`` is that backend's and opaque to callers."""

    spec: StructuredSpec
    compile_seconds: float
    payload: Any


class GrammarMatcher:
    """One sequence's position in its grammar. Not thread-safe: one thread at a time."""

    __slots__ = ()

    def accept(self, token_id: int) -> bool:
        """Advance by ``token_id``; False (state unchanged) when the grammar does not allow it."""
        raise NotImplementedError

    def accept_many(self, token_ids: Sequence[int]) -> int:
        """Accept tokens in order until one is refused; how many were accepted. Replays a sequence's
        emitted tokens to rebuild its state (on another worker, after a restart)."""
        done = 0
        for token_id in token_ids:
            if not self.accept(token_id):
                break
            done += 1
        return done

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into ``bitmask[row]`` (int32 words, bit ``t % 32`` of word
        ``t // 32`` for token ``t``; shape from ``mask.allocate_bitmask``). May take milliseconds."""
        raise NotImplementedError

    def is_terminated(self) -> bool:
        """Nothing but EOS may follow: the grammar is complete (or EOS was accepted, or ``error``)."""
        raise NotImplementedError

    def is_accepting(self) -> bool:
        """The output so far is complete under the grammar: EOS is allowed now."""
        raise NotImplementedError

    def rollback(self, n: int) -> None:
        """Undo the last ``n`` accepted tokens (EOS counts); ValueError if fewer were accepted."""
        raise NotImplementedError

    def copy(self) -> GrammarMatcher:
        """An independent matcher in the same state (for ``n > 1`` samples, speculative drafts)."""
        raise NotImplementedError

    def error(self) -> str:
        """Why the matcher failed (a grammar resource limit hit mid-sequence), else "". A failed
        matcher stays failed: its mask allows only EOS and it accepts nothing; end the sequence."""
        return ""


class GrammarBackend:
    """Base of every backend: the contract above, with the compile cache and its statistics."""

    name: ClassVar[str] = ""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: Sequence[int],
                 *, cache_size: int = DEFAULT_CACHE_SIZE) -> None:
        if vocab_size <= 0:
            raise ValueError(f"vocab_size must be positive, got {vocab_size}")
        self.vocab_size = int(vocab_size)
        self.eos_token_ids = tuple(int(t) for t in eos_token_ids)
        bad = [t for t in self.eos_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"eos_token_ids {bad} are outside the vocabulary [0, {self.vocab_size})")
        self.cache_size = max(0, int(cache_size))
        self._cache: OrderedDict[str, CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()
        self._compiles = 0
        self._cache_hits = 0
        self._last_seconds = 0.0
        self._total_seconds = 0.0

    def compile(self, spec: StructuredSpec, param: str = DEFAULT_PARAM) -> CompiledGrammar:
        """``spec`` compiled for this tokenizer, from the cache when it holds it. Thread-safe; raises
        InvalidRequestError (with the library's reason) when the constraint cannot be compiled."""
        key = spec.key
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None and hit.spec == spec:
                self._cache.move_to_end(key)
                self._cache_hits += 1
                return hit
        # Outside the lock: a large schema compiles for many milliseconds, and other requests'
        # cache hits must not wait on it. Two threads may compile one spec at once; both results work.
        start = time.perf_counter()
        payload = self._compile(spec, param)
        seconds = time.perf_counter() - start
        compiled = CompiledGrammar(spec, seconds, payload)
        with self._lock:
            self._compiles += 1
            self._last_seconds = seconds
            self._total_seconds += seconds
            if self.cache_size:
                self._cache[key] = compiled
                self._cache.move_to_end(key)
                while len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
        return compiled

    def matcher(self, compiled: CompiledGrammar) -> GrammarMatcher:
        """A fresh matcher at the start of ``compiled`` (which this backend instance compiled)."""
        raise NotImplementedError

    def stats(self) -> dict[str, float]:
        """Compile counters since construction: compiles, cache_hits, compile_seconds_{last,total}."""
        with self._lock:
            return {"compiles": self._compiles, "cache_hits": self._cache_hits,
                    "compile_seconds_last": self._last_seconds,
                    "compile_seconds_total": self._total_seconds, "cached": len(self._cache)}

    def _compile(self, spec: StructuredSpec, param: str) -> Any:
        """The backend's compiled form of ``spec`` (becomes ``CompiledGrammar.payload``)."""
        raise NotImplementedError


def make_backend(name: str, tokenizer_json: str, vocab_size: int, eos_token_ids: Sequence[int],
                 **options: Any) -> GrammarBackend:
    """The backend registered as ``name`` for this tokenizer (building one may take ~0.5 s)."""
    return backend_class(name)(tokenizer_json, vocab_size, eos_token_ids, **options)


def _load_builtin() -> None:
    # Importing registers them; here rather than at the top, as they import this module.
    from baton_serve.workers.sampling.structured import llguidance_backend  # noqa: F401


_REGISTRY: Registry[type[GrammarBackend]] = Registry("grammar backend", _load_builtin)
register_backend = _REGISTRY.register
backend_names = _REGISTRY.names
backend_class = _REGISTRY.get
