"""The llguidance backend: Earley parsing over the tokenizer's token trie, one mask in ~0.1-2 ms.

How each kind compiles:

- json / json_object: llguidance's JSON-schema compiler (json_object is ``{"type": "object"}``),
  strict: a keyword it does not implement (``if``/``then``, a remote ``$ref``...) is an error naming
  it, not silently ignored. Output is single-line JSON with ``", "`` and ``": "`` separators and no
  other whitespace, properties in the schema's order: bounded (a model cannot pad with whitespace
  forever) and the spacing models saw most in training.
- regex: the pattern, anchored at both ends (Rust ``regex`` syntax).
- choice: a Lark alternation of the strings as literals: exactly one of them.
- grammar: Lark text as llguidance reads it (``start`` rule; may embed ``%json {...}``).

EOS: the tokenizer is built with the backend's ``eos_token_ids``, so llguidance sets their bits
exactly when the grammar accepts; every other special token and every padded id is never allowed.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import llguidance
import torch
from baton_serve.workers.errors import InvalidRequestError
from baton_serve.workers.sampling.structured.backend import (
    DEFAULT_CACHE_SIZE,
    CompiledGrammar,
    GrammarBackend,
    GrammarMatcher,
    register_backend,
)
from baton_serve.workers.sampling.structured.spec import StructuredSpec

_JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_WHAT = {"json": "JSON schema", "json_object": "JSON object constraint", "regex": "regex",
         "choice": "choice list", "grammar": "Lark grammar"}


def _grammar_text(spec: StructuredSpec) -> str:
    matcher = llguidance.LLMatcher
    if spec.kind == "json":
        if spec.value == "false":
            raise ValueError("the schema is false: no output satisfies it")
        # As overrides, so a schema's own "x-guidance" options cannot change the spacing.
        # (The options need an object schema, so the boolean schema true becomes {}.)
        schema = "{}" if spec.value == "true" else spec.value
        return matcher.grammar_from_json_schema(schema, overrides=_JSON_OPTIONS)
    if spec.kind == "json_object":
        return matcher.grammar_from_json_schema('{"type":"object"}', overrides=_JSON_OPTIONS)
    if spec.kind == "regex":
        return matcher.grammar_from_regex(spec.value)
    if spec.kind == "choice":
        # JSON string syntax is Lark's literal syntax (escapes included); as a literal, no
        # character of a choice is a regex operator.
        literals = " | ".join(json.dumps(c) for c in json.loads(spec.value or "[]"))
        return matcher.grammar_from_lark(f"start: {literals}")
    return matcher.grammar_from_lark(spec.value)


def _reason(message: str) -> str:
    # Errors end with a "<non-verbose/>" marker where the parser state would be (verbose_errors off).
    return message.replace("<non-verbose/>", "").strip()


@register_backend
class LLGuidanceBackend(GrammarBackend):
    """``GrammarBackend`` on llguidance. Building one parses the tokenizer (~0.4 s for 49k tokens)."""

    name = "llguidance"

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: Sequence[int],
                 *, cache_size: int = DEFAULT_CACHE_SIZE) -> None:
        super().__init__(tokenizer_json, vocab_size, eos_token_ids, cache_size=cache_size)
        try:
            # n_vocab = the logits width: ids past the tokenizer's words get no bytes, so no bit.
            self.tokenizer = llguidance.LLTokenizer(
                tokenizer_json, n_vocab=self.vocab_size, eos_token=list(self.eos_token_ids) or None)
        except (ValueError, RuntimeError) as exc:  # e.g. "vocab size too small" (logits narrower)
            raise ValueError(f"llguidance cannot use this tokenizer with vocab_size "
                             f"{self.vocab_size}: {exc}") from exc
        self.eos_token_ids = tuple(self.tokenizer.eos_tokens)
        # Short errors: the verbose form dumps parser state and the whole grammar into messages.
        self._limits = llguidance.LLParserLimits(verbose_errors=False)

    def _compile(self, spec: StructuredSpec, param: str) -> llguidance.LLMatcher:
        what = _WHAT[spec.kind]
        try:
            grammar = _grammar_text(spec)
        except ValueError as exc:
            raise InvalidRequestError(f"the {what} cannot be compiled: {exc}", param=param) from None
        # The payload is a matcher at the start state, never advanced: deep-copying it (~10 us) is
        # far cheaper than building a matcher from the grammar text (~0.3-3 ms) per request.
        template = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0, limits=self._limits)
        if template.is_error():
            raise InvalidRequestError(f"the {what} cannot be compiled: {_reason(template.get_error())}",
                                      param=param)
        return template

    def matcher(self, compiled: CompiledGrammar) -> LLGuidanceMatcher:
        """A fresh matcher for ``compiled``; safe from any thread (the template is only read)."""
        return LLGuidanceMatcher(compiled.payload.deep_copy(), self.eos_token_ids, self.vocab_size)


class LLGuidanceMatcher(GrammarMatcher):
    """``GrammarMatcher`` over one ``llguidance.LLMatcher``; a refused token leaves it unchanged."""

    __slots__ = ("_m", "_eos", "_vocab", "_words", "num_tokens", "_unrecorded")

    def __init__(self, matcher: llguidance.LLMatcher, eos_token_ids: Sequence[int], vocab_size: int,
                 num_tokens: int = 0, unrecorded: int = 0) -> None:
        self._m = matcher
        self._eos = frozenset(eos_token_ids)
        self._vocab = vocab_size
        self._words = (vocab_size + 31) // 32
        self.num_tokens = num_tokens  # accepted so far, EOS included: the most rollback can undo
        self._unrecorded = unrecorded  # trailing EOS tokens accepted after a stop (not in llguidance)

    def accept(self, token_id: int) -> bool:
        m = self._m
        if token_id in self._eos:
            # validate_tokens answers 0 for EOS once the grammar has stopped; is_accepting is the rule.
            if not m.is_accepting():
                return False
            if m.is_stopped():
                # llguidance takes EOS after a stop without recording it, so its rollback would
                # undo an earlier token; count it here instead.
                self._unrecorded += 1
                self.num_tokens += 1
                return True
        # Validate first: a refused consume_token would put the matcher in a permanent error state.
        elif not 0 <= token_id < self._vocab or m.validate_tokens([token_id]) != 1:
            return False
        if not m.consume_token(token_id):
            return False
        self.num_tokens += 1
        return True

    def accept_many(self, token_ids: Sequence[int]) -> int:
        ids = [int(t) for t in token_ids]
        done = 0
        while done < len(ids):
            # Runs of ordinary tokens go to llguidance in one call; EOS and odd ids one at a time.
            end = done
            while end < len(ids) and ids[end] not in self._eos and 0 <= ids[end] < self._vocab:
                end += 1
            if end > done:
                taken = self._m.try_consume_tokens(ids[done:end])  # stops before a refused token
                self.num_tokens += taken
                done += taken
                if done < end:
                    break
            if done < len(ids):
                if not self.accept(ids[done]):
                    break
                done += 1
        return done

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        words = bitmask[row]
        if (bitmask.dtype != torch.int32 or bitmask.device.type != "cpu" or words.dim() != 1
                or words.numel() != self._words or not words.is_contiguous()):
            raise ValueError(f"bitmask row must be a contiguous CPU int32 vector of {self._words} words, "
                             f"got {words.dtype} {tuple(words.shape)} on {words.device}")
        self._m.unsafe_compute_mask_ptr(words.data_ptr(), self._words * 4)

    def is_terminated(self) -> bool:
        return self._m.is_stopped()  # also true once in error

    def is_accepting(self) -> bool:
        return self._m.is_accepting()

    def rollback(self, n: int) -> None:
        if not 0 <= n <= self.num_tokens:
            # Checked here: llguidance answers an over-long rollback by failing the matcher for good.
            raise ValueError(f"cannot roll back {n} tokens; {self.num_tokens} were accepted")
        phantom = min(n, self._unrecorded)
        if n > phantom and not self._m.rollback(n - phantom):
            raise RuntimeError(f"grammar rollback failed: {self.error()}")
        self._unrecorded -= phantom
        self.num_tokens -= n

    def copy(self) -> LLGuidanceMatcher:
        return LLGuidanceMatcher(self._m.deep_copy(), self._eos, self._vocab, self.num_tokens,
                                 self._unrecorded)

    def error(self) -> str:
        return _reason(self._m.get_error()) if self._m.is_error() else ""
