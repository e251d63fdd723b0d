"""Admission-time KV reservations: pure bookkeeping, separate from physical blocks.

Admission reserves a request's worst-case block count so that admitted work cannot
oversubscribe the cache; the scheduler tick allocates physical blocks later through
``BlockManager``. Terminal paths call ``release`` (safe to repeat).

A reservation may name the chain hashes of its prompt's full blocks (``shared``). Requests
holding the same prefix hold its blocks once, as the prefix cache does: each such block is charged
to the ledger while at least one live reservation pins it, not once per request. Without that, a
popular 1k-token system prompt would fill a worker's ledger with copies of blocks it holds once and
push its own followers to workers that must prefill it cold.
"""

from __future__ import annotations

from collections.abc import Sequence

from baton_serve.workers.errors import KVCacheError


class ReservationLedger:
    """Reservations keyed by request id, never totalling more than ``capacity_blocks``."""

    def __init__(self, capacity_blocks: int) -> None:
        if capacity_blocks < 0:
            raise ValueError(f"capacity_blocks must be >= 0, got {capacity_blocks}")
        self.capacity_blocks = capacity_blocks
        self._held: dict[str, tuple[int, tuple[bytes, ...]]] = {}  # id -> (blocks, shared hashes)
        self._pins: dict[bytes, int] = {}  # shared block hash -> live reservations naming it
        self._own = 0  # blocks no other reservation can share

    @property
    def reserved_blocks(self) -> int:
        return self._own + len(self._pins)

    @property
    def available_blocks(self) -> int:
        return self.capacity_blocks - self.reserved_blocks

    def shared_blocks(self, shared: Sequence[bytes]) -> int:
        """How many of ``shared`` live reservations already pin (a new one naming them adds none)."""
        return sum(1 for h in set(shared) if h in self._pins)

    def charge(self, num_blocks: int, shared: Sequence[bytes] = ()) -> int:
        """The blocks a reservation of ``num_blocks`` naming ``shared`` would take from the ledger now."""
        return num_blocks - self.shared_blocks(shared)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._held

    def __len__(self) -> int:
        return len(self._held)

    def reserve(self, request_id: str, num_blocks: int, force: bool = False, shared: Sequence[bytes] = ()) -> bool:
        """Hold ``num_blocks`` for ``request_id``, of which ``shared`` (distinct chain hashes of its
        prompt's full blocks) are held once however many reservations name them; False (nothing
        changed) if over capacity, unless ``force`` (admission chose to oversubscribe:
        ``available_blocks`` then goes negative).

        Raises ``KVCacheError`` for a negative count, more shared blocks than blocks, or a request
        that already holds a reservation (admitting it twice is a caller bug).
        """
        shared = tuple(dict.fromkeys(shared))
        if num_blocks < 0:
            raise KVCacheError(f"cannot reserve {num_blocks} blocks")
        if len(shared) > num_blocks:
            raise KVCacheError(f"{len(shared)} shared blocks in a reservation of {num_blocks}")
        if request_id in self._held:
            raise KVCacheError(f"request {request_id!r} already holds a reservation")
        if self.reserved_blocks + self.charge(num_blocks, shared) > self.capacity_blocks and not force:
            return False
        self._held[request_id] = (num_blocks, shared)
        self._own += num_blocks - len(shared)
        for h in shared:
            self._pins[h] = self._pins.get(h, 0) + 1
        return True

    def release(self, request_id: str) -> int:
        """Drop the reservation; returns the blocks it asked for (0 if none, e.g. a repeat call)."""
        num_blocks, shared = self._held.pop(request_id, (0, ()))
        self._own -= num_blocks - len(shared)
        for h in shared:
            left = self._pins[h] - 1
            if left:
                self._pins[h] = left
            else:
                del self._pins[h]
        return num_blocks
