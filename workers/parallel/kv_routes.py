"""Which prefill rank sends which KV heads to which decode rank, when a prefill replica of one
tensor-parallel size ships to a decode replica of another (KV resharding).

Each decode rank gets exactly the KV heads its cache holds, each from a prefill rank that holds
it; no rank gathers the whole cache. Where several prefill ranks hold a head (more ranks than KV
heads), the senders are spread over them so that one rank does not carry every route.
"""

from __future__ import annotations

from dataclasses import dataclass

from baton_serve.workers.parallel.sizes import kv_head_owners, kv_heads_of_rank


@dataclass(frozen=True)
class KVRoute:
    """KV heads ``[head, head + count)`` (global numbering) from prefill rank ``src_rank`` to
    decode rank ``dst_rank``; ``src_first``/``dst_first``: where they start in each rank's cache."""

    src_rank: int
    dst_rank: int
    head: int
    count: int
    src_first: int
    dst_first: int

    @property
    def src_heads(self) -> tuple[int, int]:
        return self.src_first, self.src_first + self.count

    @property
    def dst_heads(self) -> tuple[int, int]:
        return self.dst_first, self.dst_first + self.count


def reshard_routes(num_kv_heads: int, src_tp: int, dst_tp: int) -> list[KVRoute]:
    """The routes that fill every decode rank of a ``dst_tp`` replica from a ``src_tp`` one, in
    (decode rank, head) order; consecutive heads on one pair of ranks travel as one route."""
    owners = kv_head_owners(num_kv_heads, src_tp)
    routes: list[KVRoute] = []
    for dst in range(dst_tp):
        first, count = kv_heads_of_rank(num_kv_heads, dst_tp, dst)
        for head in range(first, first + count):
            holders = owners[head]
            # the i-th decode rank holding a replicated head takes it from the i-th holder (mod)
            src = holders[_replica_index(num_kv_heads, dst_tp, dst) % len(holders)]
            src_first = head - kv_heads_of_rank(num_kv_heads, src_tp, src)[0]
            last = routes[-1] if routes else None
            if (last is not None and last.src_rank == src and last.dst_rank == dst
                    and last.head + last.count == head and last.src_first + last.count == src_first):
                routes[-1] = KVRoute(src, dst, last.head, last.count + 1, last.src_first, last.dst_first)
            else:
                routes.append(KVRoute(src, dst, head, 1, src_first, head - first))
    return routes


def _replica_index(num_kv_heads: int, tp: int, rank: int) -> int:
    # Which copy of its KV head a rank holds, where ranks outnumber heads (0 otherwise).
    return rank % (tp // num_kv_heads) if tp > num_kv_heads else 0
