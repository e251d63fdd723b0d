"""Token bitmasks: one int32 word per 32 token ids (bit ``t % 32`` of word ``t // 32``, 1 = allowed),
filled by matchers on the CPU, applied to logits in place with vectorised torch."""

from __future__ import annotations

from collections.abc import Sequence

import torch

_BITS: dict[torch.device, torch.Tensor] = {}


def bitmask_words(vocab_size: int) -> int:
    """Words per bitmask row for a logits width of ``vocab_size``."""
    return (vocab_size + 31) // 32


def allocate_bitmask(rows: int, vocab_size: int, pin_memory: bool = False) -> torch.Tensor:
    """A ``[rows, ceil(vocab_size / 32)]`` int32 CPU bitmask with every token allowed. Pinned memory
    lets a later copy to the GPU run asynchronously."""
    return torch.full((rows, bitmask_words(vocab_size)), -1, dtype=torch.int32, pin_memory=pin_memory)


def _bits(device: torch.device) -> torch.Tensor:
    bits = _BITS.get(device)
    if bits is None:  # 1 << 31 wraps to -2**31 in int32: still exactly bit 31
        bits = _BITS[device] = (torch.ones(32, dtype=torch.int64) << torch.arange(32)).to(torch.int32).to(device)
    return bits


def _refused(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    # One AND and one compare per token; the reshape is a view, the slice too.
    refused = ((bitmask.unsqueeze(-1) & _bits(bitmask.device)) == 0).reshape(bitmask.shape[0], -1)
    width = refused.shape[1]
    if width >= vocab_size:
        return refused[:, :vocab_size]
    return torch.cat([refused, refused.new_ones(refused.shape[0], vocab_size - width)], dim=1)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The bool ``[rows, vocab_size]`` allowed-matrix of ``bitmask``; ids past its words are False."""
    return ~_refused(bitmask, vocab_size)


def apply_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int]) -> None:
    """In place: for each j, set ``logits[rows[j], t] = -inf`` wherever bit t of ``bitmask[j]`` is 0.

    ``bitmask`` is indexed by position in ``rows`` (its first ``len(rows)`` rows are read), so a
    batch fills a compact mask for just its constrained sequences; other logits rows are untouched.
    ``rows`` must be distinct. ``logits`` may be on any device; the mask is copied there.
    """
    if not len(rows):
        return
    if bitmask.dtype != torch.int32 or bitmask.dim() != 2 or bitmask.shape[0] < len(rows):
        raise ValueError(f"bitmask must be int32 [>= {len(rows)}, words], got {bitmask.dtype} "
                         f"{tuple(bitmask.shape)}")
    words = bitmask[: len(rows)].to(logits.device, non_blocking=True)
    refused = _refused(words, logits.shape[-1])
    rows = [int(r) for r in rows]
    if rows == list(range(logits.shape[0])):
        logits.masked_fill_(refused, float("-inf"))  # every row, in order: no gather/scatter
        return
    index = torch.tensor(rows, dtype=torch.long, device=logits.device)
    picked = logits.index_select(0, index)
    picked.masked_fill_(refused, float("-inf"))
    logits.index_copy_(0, index, picked)
