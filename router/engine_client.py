"""What the HTTP front needs from whatever runs the model: one protocol, several backends.

``workers.engine.async_engine.AsyncEngine`` (colocated, in-process) implements it; the cluster's
client for prefill/decode pools of Ray actors implements the same methods.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Protocol

from baton_serve.workers.engine.outputs import TokenDelta
from baton_serve.workers.sampling.params import SamplingParams


class Ticket(Protocol):
    """A request's admission handle (``cluster.admission.gate.Ticket``): its tenant, what stage 2
    charged and queued for it, and what it capped."""

    queue_time_s: float
    degraded: dict[str, int]

    @property
    def tenant_name(self) -> str: ...

    def charge_tokens(self, tokens: int) -> None: ...

    def priority(self, request_priority: int) -> int: ...

    def cache_salt(self, client_salt: str | None) -> str | None: ...

    def mark_first_token(self) -> None: ...

    def finish(self, status: int, finish_reason: str, prompt_tokens: int = 0, cached_tokens: int = 0,
               completion_tokens: int = 0) -> bool: ...


class EngineClient(Protocol):
    """Token ids in, token deltas out. Detokenization and stop strings are the front's job."""

    def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 priority: int = 0, cache_salt: str | None = None,
                 arrival_time: float | None = None, ticket: Ticket | None = None) -> AsyncIterator[TokenDelta]:
        """Stream deltas of all ``params.n`` samples until each has a finish_reason.

        ``ticket`` (when admission runs) names the tenant, whose share the scheduler keeps fair,
        and takes stage 2's charges; a backend with no KV admission of its own only reads it.

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
