"""Host-memory KV blocks for preemption by swap: a free list of ids plus the copy plan type.

Swapping frees device blocks like recompute does, but keeps the computed KV: the victim's
blocks are copied to host blocks before anything reuses them, and copied back on resume.
"""

from __future__ import annotations


class HostBlockPool:
    """``num_blocks`` host blocks, ids ``0..num_blocks-1``; all-or-nothing allocation."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out 0, 1, 2, ...

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        """``n`` block ids, or None (nothing taken) when fewer are free."""
        if n > len(self._free):
            return None
        return [self._free.pop() for _ in range(n)]

    def free(self, ids: list[int]) -> None:
        self._free.extend(reversed(ids))
