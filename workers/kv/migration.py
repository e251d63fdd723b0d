"""Moving a request's KV between workers (disaggregated prefill/decode): ``KVMigration``.

Ownership follows one contract: the prefill engine parks a request after its first token and
keeps its blocks; the decode engine reserves blocks (``reserve_remote``) and says which logical
blocks it still needs (its own prefix cache may hold the rest); the data moves; the decode
engine admits the request (``admit_remote``); only then the prefill engine releases its blocks
(``release_parked``). Every step has a failure path: ``cancel_remote`` on the decode side and
``release_parked`` on the prefill side free what they hold.
All methods must run on the engine's loop thread.

``KVMigration`` owns the requests held outside the scheduler for this (``parked``, ``incoming``)
and reaches the engine only through ``MigrationHost``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, Protocol

import torch
from baton_serve.workers.blocks.manager import BlockManager
from baton_serve.workers.engine.request import Request, RequestStatus
from baton_serve.workers.engine.scheduler import Scheduler
from baton_serve.workers.engine.structured import StructuredOutputs
from baton_serve.workers.errors import OutOfBlocksError
from baton_serve.workers.sampling.params import SamplingParams


@dataclass
class MigrationMeta:
    """Everything a decode worker needs to continue a request (msgpack-friendly)."""

    request_id: str  # the client request (group) id
    member_id: str
    index: int
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    params: dict[str, Any]
    max_total_tokens: int
    priority: int
    cache_salt: str | None
    age_s: float  # seconds since arrival, so queue/TTFT metrics survive the hop
    num_cached_tokens: int
    generator_state: bytes | None
    tenant: str = ""  # whom the decode worker's fair scheduler counts it for
    kv_checksums: list[int] | None = None  # CRC-32 per logical block (workers.kv.integrity), set by the sender

    def sampling_params(self) -> SamplingParams:
        raw = dict(self.params)
        if raw.get("logit_bias"):
            raw["logit_bias"] = {int(k): v for k, v in raw["logit_bias"].items()}
        return SamplingParams(**raw)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class MigrationHost(Protocol):
    """What ``KVMigration`` needs of the engine it serves (``EngineCore``)."""

    block_manager: BlockManager
    scheduler: Scheduler
    structured: StructuredOutputs
    clock: Callable[[], float]  # the engine's time: a request's age travels with it

    def adopt_member(self, req: Request) -> None:
        """Track an arrived sample as a member of its client request (its group made if new)."""

    def forget(self, req: Request) -> str:
        """Drop a terminal sample from the engine's bookkeeping; returns its client request id."""


class KVMigration:
    """The engine's KV hand-offs; see the module docstring for the contract.

    ``parked``: prefill done, KV held until shipped. ``incoming``: blocks reserved, KV being received.
    Neither is in the scheduler; both hold blocks that only this class (or ``take``'s caller) frees.
    """

    def __init__(self, host: MigrationHost) -> None:
        self.host = host
        self.parked: dict[str, Request] = {}
        self.incoming: dict[str, Request] = {}

    def park(self, req: Request) -> None:
        """Take a running request out of scheduling after its first token, keeping its blocks."""
        self.host.scheduler.detach(req)
        self.parked[req.request_id] = req

    def take(self, member_id: str) -> Request | None:
        """Stop holding a parked or incoming request that is ending otherwise (an abort); the caller
        frees its blocks. None when this holds neither."""
        return self.parked.pop(member_id, None) or self.incoming.pop(member_id, None)

    # ------------------------------------------------------------------ prefill side
    def migration_meta(self, member_id: str) -> tuple[MigrationMeta, list[int]]:
        """The parked request's meta and its block table (physical ids, logical order)."""
        req = self.parked[member_id]
        state = req.generator.get_state().numpy().tobytes() if req.generator is not None else None
        meta = MigrationMeta(
            request_id=req.parent_id or req.request_id, member_id=req.request_id, index=req.index,
            prompt_token_ids=list(req.prompt_token_ids), output_token_ids=req.output_token_ids,
            params=asdict(req.params), max_total_tokens=req.max_total_tokens, priority=req.priority,
            cache_salt=req.cache_salt, age_s=self.host.clock() - req.arrival_time,
            num_cached_tokens=max(req.num_cached_tokens, 0), generator_state=state, tenant=req.tenant)
        return meta, list(self.host.block_manager.block_table(member_id))

    def release_parked(self, member_id: str) -> bool:
        """Free a parked request's blocks after its KV was shipped (or shipping failed). Idempotent."""
        req = self.parked.pop(member_id, None)
        if req is None:
            return False
        self.host.block_manager.free(member_id)
        req.status = RequestStatus.MIGRATED
        self.host.forget(req)
        return True

    # ------------------------------------------------------------------ decode side
    def reserve_remote(self, meta: MigrationMeta) -> list[int]:
        """Allocate blocks for a request arriving with its KV; return the logical block indices
        whose data must be received (blocks this worker's prefix cache already holds are skipped).

        Raises OutOfBlocksError, changing nothing, when the blocks are not free now.
        """
        params = meta.sampling_params()
        req = Request(meta.member_id, meta.prompt_token_ids, params, meta.max_total_tokens,
                      arrival_time=self.host.clock() - meta.age_s, priority=meta.priority,
                      cache_salt=meta.cache_salt, parent_id=meta.request_id, index=meta.index,
                      tenant=meta.tenant)
        for tok in meta.output_token_ids:
            req.append_token(tok)
        # The grammar's state does not travel: it is rebuilt from the tokens emitted so far.
        req.matcher = self.host.structured.matcher(params, req.output_token_ids)
        if meta.generator_state is not None:
            gen = torch.Generator()
            gen.set_state(torch.frombuffer(bytearray(meta.generator_state), dtype=torch.uint8))
            req.generator = gen
        computed = req.num_tokens - 1  # every position but the last sampled token has KV
        bm = self.host.block_manager
        cached = bm.find_cached_prefix(req.request_id, req.all_token_ids, req.cache_salt)
        if not bm.allocate(req.request_id, req.all_token_ids, cached, computed - cached,
                           num_cached_tokens=cached, salt=req.cache_salt):
            bm.free(req.request_id)
            raise OutOfBlocksError(f"no room for {computed} tokens of KV for {meta.member_id}")
        req.num_cached_tokens = meta.num_cached_tokens
        req.num_computed_tokens = computed
        self.incoming[req.request_id] = req
        bs = bm.block_size
        needed = list(range(cached // bs, (computed + bs - 1) // bs))
        if meta.kv_checksums is not None:
            # Checked once the data is in, before admission: only the blocks that travel (our own
            # cached prefix was computed here, perhaps by other kernels, bit for bit otherwise).
            table = bm.block_table(req.request_id)
            req.kv_expect = [(table[i], i, meta.kv_checksums[i]) for i in needed if i < len(meta.kv_checksums)]
        return needed

    def incoming_block_table(self, member_id: str) -> list[int]:
        """Where a reserved request's KV goes (physical ids, logical order)."""
        return list(self.host.block_manager.block_table(member_id))

    def admit_remote(self, member_id: str) -> None:
        """The KV has arrived: publish its full blocks to the prefix cache and start decoding."""
        req = self.incoming.pop(member_id)
        self.host.block_manager.commit_computed(req.request_id, req.all_token_ids, req.num_computed_tokens)
        self.host.adopt_member(req)
        self.host.scheduler.admit_running(req)

    def cancel_remote(self, member_id: str) -> bool:
        """Drop a reservation whose KV never arrived. Idempotent."""
        req = self.incoming.pop(member_id, None)
        if req is None:
            return False
        self.host.block_manager.free(member_id)
        return True
