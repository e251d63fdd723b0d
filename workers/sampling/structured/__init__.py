"""Grammar-constrained decoding: specs, backends chosen by name, token bitmasks (issue 19)."""

from baton_serve.workers.sampling.structured.backend import (
    DEFAULT_BACKEND,
    CompiledGrammar,
    GrammarBackend,
    GrammarMatcher,
    backend_class,
    backend_names,
    make_backend,
    register_backend,
)
from baton_serve.workers.sampling.structured.llguidance_backend import LLGuidanceBackend, LLGuidanceMatcher
from baton_serve.workers.sampling.structured.mask import (
    allocate_bitmask,
    apply_bitmask_,
    bitmask_words,
    unpack_bitmask,
)
from baton_serve.workers.sampling.structured.spec import KINDS, StructuredSpec

__all__ = [
    "DEFAULT_BACKEND", "KINDS", "CompiledGrammar", "GrammarBackend", "GrammarMatcher", "LLGuidanceBackend",
    "LLGuidanceMatcher", "StructuredSpec", "allocate_bitmask", "apply_bitmask_", "backend_class",
    "backend_names", "bitmask_words", "make_backend", "register_backend", "unpack_bitmask",
]
