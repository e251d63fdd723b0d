"""What one step does to the model and its KV cache, as plain lists: the flat inputs of the forward,
the block copies and swaps before it.

The model runner builds it from the scheduler's output and runs it; in a tensor-parallel
replica rank 0 sends it (msgpack, one message per step) and every other rank runs the same plan
on its shard, so all ranks agree on every slot without scheduling anything themselves.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import msgpack


@dataclass
class StepPlan:
    """One step's work; a plan without tokens only moves blocks (a tick that only swaps)."""

    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    num_decode_tokens: int = 0
    decode_tables: list[list[int]] = field(default_factory=list)
    decode_lens: list[int] = field(default_factory=list)
    prefill_tables: list[list[int]] = field(default_factory=list)
    prefill_lens: list[int] = field(default_factory=list)
    prefill_starts: list[int] = field(default_factory=lambda: [0])
    sample_rows: list[int] = field(default_factory=list)  # token rows whose logits are sampled
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst)
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, host block)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host block, device block)

    @property
    def has_forward(self) -> bool:
        return bool(self.input_ids)

    def encode(self) -> bytes:
        # the fields as they are (dataclasses.astuple would deep-copy every list first)
        return msgpack.packb([getattr(self, name) for name in _FIELDS], use_bin_type=True)

    @classmethod
    def decode(cls, data: bytes) -> StepPlan:
        values = msgpack.unpackb(data, raw=False, strict_map_key=False)
        if len(values) != len(_FIELDS):
            raise ValueError(f"a step plan has {len(_FIELDS)} fields, got {len(values)}")
        return cls(*values)


_FIELDS = tuple(f.name for f in dataclasses.fields(StepPlan))
