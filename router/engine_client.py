"""What the HTTP front needs from whatever runs the model: one protocol, several backends.

``workers.engine.async_engine.AsyncEngine`` (colocated, in-process) implements it; the cluster's
client for prefill/decode pools of Ray actors implements the same methods.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Protocol

from workers.engine.outputs import TokenDelta
from workers.sampling.params import SamplingParams


class EngineClient(Protocol):
    """Token ids in, token deltas out. Detokenization and stop strings are the front's job."""

    def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 priority: int = 0, cache_salt: str | None = None,
                 arrival_time: float | None = None) -> AsyncIterator[TokenDelta]:
        """Stream deltas of all ``params.n`` samples until each has a finish_reason.

        Raises ``InvalidRequestError`` before queueing when the request cannot run. Closing the
        iterator early aborts the request and frees its KV.
        """
        ...

    def abort(self, request_id: str) -> None:
        """Abort a request; unknown or finished ids are ignored."""
        ...

    def finish_sample(self, request_id: str, index: int, stop: str) -> None:
        """A stop string matched on the front: stop generating that sample."""
        ...

    def stats(self) -> Any:
        """Load summary for metrics and readiness (``workers.engine.async_engine.EngineStats``)."""
        ...
