"""Structured output in the engine: one grammar matcher per constrained sample, and the step's bitmasks.

The backend (``workers.sampling.structured``) is built on the first constrained request, since
building its tokenizer view takes a few tenths of a second that unconstrained deployments should
never pay. A sample's matcher follows the tokens it emits; a sample arriving from another worker
(the KV hop, a migration) rebuilds its matcher from the tokens it has emitted so far.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from baton_serve.workers.errors import InvalidRequestError
from baton_serve.workers.sampling.params import SamplingParams
from baton_serve.workers.sampling.structured import (
    DEFAULT_BACKEND,
    GrammarMatcher,
    StructuredSpec,
    allocate_bitmask,
    make_backend,
)


class StructuredOutputs:
    """Compiles grammars (cached by the backend) and fills the bitmasks of a step's constrained rows."""

    def __init__(self, tokenizer_json: str | None, vocab_size: int, eos_token_ids: Sequence[int],
                 backend: str = DEFAULT_BACKEND) -> None:
        self.tokenizer_json, self.vocab_size, self.eos_token_ids = tokenizer_json, vocab_size, list(eos_token_ids)
        self.backend_name = backend
        self._backend: Any = None

    @property
    def backend(self) -> Any:
        if self._backend is None:
            if self.tokenizer_json is None:
                raise InvalidRequestError("structured output needs the model's tokenizer, which this engine "
                                          "was built without", param="response_format")
            self._backend = make_backend(self.backend_name, self.tokenizer_json, self.vocab_size,
                                         self.eos_token_ids)
        return self._backend

    def matcher(self, params: SamplingParams, output_token_ids: Sequence[int] = ()) -> GrammarMatcher | None:
        """A fresh matcher for ``params``' grammar (None when unconstrained), advanced over
        ``output_token_ids``. Raises InvalidRequestError when the grammar does not compile or
        the tokens do not follow it."""
        if params.structured_outputs is None:
            return None
        spec = StructuredSpec.from_dict(params.structured_outputs, param="structured_outputs")
        matcher = self.backend.matcher(self.backend.compile(spec, param="structured_outputs"))
        if output_token_ids and matcher.accept_many(output_token_ids) != len(output_token_ids):
            raise InvalidRequestError("the tokens emitted so far do not follow the request's grammar",
                                      param="structured_outputs")
        return matcher

    def fill(self, rows: Sequence[Any], matchers: Sequence[GrammarMatcher | None]) -> None:
        """Give every constrained row its bitmask for this step (``row.grammar_bitmask``)."""
        live = [i for i, m in enumerate(matchers) if m is not None]
        if not live:
            return
        bitmask = allocate_bitmask(len(live), self.vocab_size)
        for j, i in enumerate(live):
            matchers[i].fill_bitmask(bitmask, j)
            rows[i].grammar_bitmask = bitmask[j]
