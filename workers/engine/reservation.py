"""Admission-time KV reservations: pure bookkeeping, separate from physical blocks.

Admission reserves a request's worst-case block count so that admitted work cannot
oversubscribe the cache; the scheduler tick allocates physical blocks later through
``BlockManager``. Terminal paths call ``release`` (safe to repeat).
"""

from __future__ import annotations

from workers.errors import KVCacheError


class ReservationLedger:
    """Reservations keyed by request id, never totalling more than ``capacity_blocks``."""

    def __init__(self, capacity_blocks: int) -> None:
        if capacity_blocks < 0:
            raise ValueError(f"capacity_blocks must be >= 0, got {capacity_blocks}")
        self.capacity_blocks = capacity_blocks
        self._held: dict[str, int] = {}
        self._reserved = 0

    @property
    def reserved_blocks(self) -> int:
        return self._reserved

    @property
    def available_blocks(self) -> int:
        return self.capacity_blocks - self._reserved

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._held

    def __len__(self) -> int:
        return len(self._held)

    def reserve(self, request_id: str, num_blocks: int, force: bool = False) -> bool:
        """Hold ``num_blocks`` for ``request_id``; False (nothing changed) if over capacity, unless
        ``force`` (admission chose to oversubscribe: ``available_blocks`` then goes negative).

        Raises ``KVCacheError`` for a negative count or a request that already holds a
        reservation (admitting it twice is a caller bug).
        """
        if num_blocks < 0:
            raise KVCacheError(f"cannot reserve {num_blocks} blocks")
        if request_id in self._held:
            raise KVCacheError(f"request {request_id!r} already holds a reservation")
        if self._reserved + num_blocks > self.capacity_blocks and not force:
            return False
        self._held[request_id] = num_blocks
        self._reserved += num_blocks
        return True

    def release(self, request_id: str) -> int:
        """Drop the reservation; returns the blocks it held (0 if none, e.g. a repeat call)."""
        num_blocks = self._held.pop(request_id, 0)
        self._reserved -= num_blocks
        return num_blocks
