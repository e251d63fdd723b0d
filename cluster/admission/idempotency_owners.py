"""Which front records each idempotent run, when several HTTP fronts share a port.

The kernel spreads connections over the fronts, so a retry can land on a front other than the one
generating the first try. Every front claims a key here first (``IdempotencyOwners``, one small
actor per deployment); a front that does not own it replays the owner's record over Ray
(``RayRunOwners.fetch`` -> ``HTTPFront.idempotent_snapshot``) instead of generating again. The
claim lives as long as the owner keeps the run: released when it ends (kept ``ttl_s`` for replays,
or dropped when it failed before sending anything, so a retry runs anew), taken over when the
owner is gone.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from baton_serve.router.idempotency import IdempotencyConflict


@dataclass
class _Claim:
    owner: str
    fingerprint: str
    expires: float | None = None  # None while the owner's run is live


class IdempotencyOwners:
    """(scope, key) -> owning front (plain class; ``start_fronts`` makes it an actor)."""

    def __init__(self, ttl_s: float = 3600.0, max_entries: int = 100_000) -> None:
        self.ttl_s, self.max_entries = ttl_s, max_entries
        self._claims: dict[tuple[str, str], _Claim] = {}

    def claim(self, scope: str, key: str, fingerprint: str, front: str, replace: str | None = None) -> str:
        """The owner's id (``front`` when it takes the key); ``"conflict"`` for another body."""
        now = time.monotonic()
        k = (scope, key)
        c = self._claims.get(k)
        if c is not None and c.expires is not None and c.expires <= now:
            c = None
        if c is not None and c.fingerprint != fingerprint:
            return "conflict"
        if c is None or (replace is not None and c.owner == replace):
            if len(self._claims) >= self.max_entries:
                self._expire(now)
            self._claims[k] = _Claim(front, fingerprint)
            return front
        return c.owner

    def release(self, scope: str, key: str, front: str, keep: bool) -> None:
        c = self._claims.get((scope, key))
        if c is None or c.owner != front:
            return
        if keep:
            c.expires = time.monotonic() + self.ttl_s
        else:
            del self._claims[(scope, key)]

    def size(self) -> int:
        return len(self._claims)

    def _expire(self, now: float) -> None:
        for k in [k for k, c in self._claims.items() if c.expires is not None and c.expires <= now]:
            del self._claims[k]


class RayRunOwners:
    """``router.gateway.RunOwners`` over the owners actor and the other fronts' handles."""

    def __init__(self, directory: Any, front_id: str) -> None:
        self.directory, self.front_id = directory, front_id
        self.fronts: dict[str, Any] = {}  # front id -> HTTPFront handle, set once all have started

    async def claim(self, scope: str, key: str, fingerprint: str, replace: str | None = None) -> str:
        owner = await self.directory.claim.remote(scope, key, fingerprint, self.front_id, replace)
        if owner == "conflict":
            raise IdempotencyConflict(f"Idempotency-Key {key!r} was already used with a different request body")
        return owner

    async def release(self, scope: str, key: str, keep: bool) -> None:
        await self.directory.release.remote(scope, key, self.front_id, keep)

    async def fetch(self, owner: str, scope: str, key: str, after: int, wait_s: float) -> dict[str, Any] | None:
        front = self.fronts.get(owner)
        if front is None:
            raise RuntimeError(f"front {owner!r} is not known")
        return await front.idempotent_snapshot.remote(scope, key, after, wait_s)
