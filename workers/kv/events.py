"""Prefix-cache events a worker publishes so a cache-aware router can mirror its cache.

Events describe the *logical* cache (block hashes), never physical block ids, so a
router can compare hashes across replicas that share a namespace.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class BlockStored:
    """Full blocks became hittable, in chain order.

    ``parent_hash`` is the hash of the block before ``block_hashes[0]``; ``None``
    means the first block starts the chain (token position 0). ``token_ids`` holds
    the tokens of all stored blocks concatenated (``len == len(block_hashes) * block_size``).
    """

    block_hashes: list[bytes]
    parent_hash: bytes | None
    token_ids: list[int]
    block_size: int


@dataclass(frozen=True)
class BlockRemoved:
    """These hashes are no longer hittable (their blocks were evicted for reuse)."""

    block_hashes: list[bytes] = field(default_factory=list)


@dataclass(frozen=True)
class AllBlocksCleared:
    """Every previously announced hash is gone (prefix cache reset)."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared
