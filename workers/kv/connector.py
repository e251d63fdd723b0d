"""The KV connector contract: how a parked request's KV moves from a prefill worker into a decode
worker. One implementation per transport, each registered by name (``register_connector``), made
by ``make_connector``; the Worker calls only this interface.

Prefill side (the sender; on the prefill worker's shipping threads):

- ``reaches(peer_id, peer)``: whether this connector can serve that decode worker at all (shared
  memory: only a peer on this machine that maps our cache). Asked before ``send``; may be cached.
- ``send(peer_id, peer, shipment)``: offer the sample to the peer (it reserves blocks, or says it
  is full and we retry until the KV timeout), move the data, and return once the peer has admitted
  the sample; the bytes moved. Any failure raises, leaving the peer's state to ``abandon``.
- ``abandon(peer_id, peer, shipment)``: after a failed ``send``: withdraw whatever the peer holds
  for the sample, returning only once it can no longer read our blocks (they are freed next), and
  reset this connector's state for that peer (a broken pair group) so the next request starts clean.

Decode side (the receiver; in the decode worker's RPCs, ``Worker.kv_*``):

- ``accept(peer_id, info)``: a sender's one-off set-up call (join its pair group, map its cache).
- ``reserve(meta, front_id)``: allocate blocks for an arriving sample: (logical block indices still
  needed, their physical ids), or None when full now. Blocks already in this worker's prefix cache
  are not asked for.
- ``receive(peer_id, member_id, blocks, payload)``: take the data into the reserved ``blocks`` and
  admit the sample (at most once); the bytes received, or None when full now (a connector that
  reserves inside ``receive``). A withdrawn or aborted sample is refused, its reservation freed.
- Cancelling a reservation is the same for every transport: ``Worker.kv_cancel``.

Whatever the transport: a sample is admitted at most once, every reservation is freed on every exit
path, and no call waits longer than the worker's KV timeout.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

from baton_serve.workers.errors import KVTransferError, OutOfBlocksError
from baton_serve.workers.kv.integrity import corrupt_block, verify_blocks
from baton_serve.workers.kv.migration import MigrationMeta
from baton_serve.workers.registry import Registry

# Tried in this order by transport "auto": the first that reaches the peer ships to it.
AUTO_ORDER = ("shared_memory", "collective")


@dataclass
class KVShipment:
    """One parked sample to ship: its request, engine member id, metadata and block table."""

    request_id: str
    member_id: str
    meta: MigrationMeta
    table: list[int]  # the sender's physical blocks, by logical index


class KVHost(Protocol):
    """What a connector needs from the worker it serves (``workers.actor.worker.Worker``)."""

    worker_id: str
    host: str  # the address this worker listens on
    kv_timeout_s: float
    engine: Any  # AsyncEngine: every engine access goes through its loop thread
    core: Any  # EngineCore, for reads that are safe off the loop thread
    transfer: Any  # KVTransferEngine over this worker's cache
    faults: Any  # workers.actor.faults.FaultPoints: what the fault suite armed
    verify_kv: bool  # checksums travel with the KV
    tp_size: int  # ranks of this worker's tensor-parallel replica (1: one cache)
    num_kv_heads: int  # the model's KV heads, across every rank
    tp_agents: list[Any]  # each rank's KV agent (workers.parallel.kv_agent), by rank

    def kv_layout(self) -> dict[str, int]: ...

    def register(self, request_id: str, front_id: str, index: int) -> None: ...
    def owner_front(self, request_id: str) -> str: ...
    def refuses(self, request_id: str) -> bool: ...
    def take_withdrawn(self, member_id: str) -> bool: ...
    def forget_sample(self, request_id: str, index: int) -> None: ...
    def admit(self, member_id: str) -> None: ...
    def admit_here(self, engine: Any, member_id: str) -> None: ...


class KVConnector:
    """Base of every connector: the contract above, with the decode-side reservation that the
    transports which move data after reserving share."""

    name: ClassVar[str] = ""
    needs_shared_cache: ClassVar[bool] = False  # the prefill worker's cache must be exportable

    def __init__(self, host: KVHost) -> None:
        self.host = host

    # ------------------------------------------------------------------ prefill side
    def reaches(self, peer_id: str, peer: Any) -> bool:
        return True

    def send(self, peer_id: str, peer: Any, shipment: KVShipment) -> int:
        raise NotImplementedError

    def abandon(self, peer_id: str, peer: Any, shipment: KVShipment) -> None:
        peer.kv_cancel.remote(shipment.member_id, shipment.meta.index)  # our blocks are not read once send has failed

    # ------------------------------------------------------------------ decode side
    def accept(self, peer_id: str, info: Any) -> bool:
        raise ValueError(f"connector {self.name!r} takes no set-up call")

    def reserve(self, meta: dict[str, Any], front_id: str) -> tuple[list[int], list[int]] | None:
        m = MigrationMeta(**meta)
        if self.host.refuses(m.request_id):
            raise KVTransferError(f"request {m.request_id} was aborted")
        self.host.register(m.request_id, front_id, m.index)

        def reserve(engine: Any) -> tuple[list[int], list[int]]:
            if self.host.take_withdrawn(m.member_id):  # its sender gave up before this ran
                self.host.forget_sample(m.request_id, m.index)
                raise KVTransferError(f"{m.member_id} was withdrawn by its sender")
            needed = engine.reserve_remote(m)
            table = engine.incoming_block_table(m.member_id)
            return needed, [table[i] for i in needed]

        try:
            return self.host.engine.call(reserve)
        except OutOfBlocksError:
            return None

    def receive(self, peer_id: str, member_id: str, blocks: list[int] | None, payload: Any) -> int | None:
        raise NotImplementedError

    def check_received(self, member_id: str) -> None:
        """The sample's KV is in its reserved blocks: raise KVTransferError unless it matches the
        sender's checksums (``workers.kv.integrity``). Call before admitting it."""
        host = self.host
        req = host.core.incoming.get(member_id)
        expect = req.kv_expect if req is not None else None
        if not expect:
            return
        caches, bs = host.core.runner.kv_caches, host.core.config.block_size
        if host.faults.fire("corrupt_received_kv"):
            corrupt_block(caches, expect[0][0])
        verify_blocks(caches, expect, req.num_computed_tokens, bs, member_id)

    # ------------------------------------------------------------------ both
    def peers_changed(self, peers: dict[str, Any]) -> None:
        """The worker's peers are now ``peers``: forget state kept for any that left."""

    def stats(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        pass

    # ------------------------------------------------------------------ helpers
    def until_room(self, meta: MigrationMeta, ask: Callable[[str], Any]) -> Any:
        """Call ``ask(front_id)`` (a decode worker RPC) until it answers other than None (None: no
        free blocks there now), backing off, until the KV timeout (``OutOfBlocksError``)."""
        deadline = time.monotonic() + self.host.kv_timeout_s
        delay = 0.01
        while True:
            answer = ray_get(ask(self.host.owner_front(meta.request_id)), self.host.kv_timeout_s)
            if answer is not None:
                return answer
            if time.monotonic() > deadline:
                raise OutOfBlocksError(f"decode worker had no room for {meta.member_id} within "
                                       f"{self.host.kv_timeout_s}s")
            time.sleep(delay)
            delay = min(delay * 2, 0.5)


def _load_builtin() -> None:
    # Importing registers them; here rather than at the top, as they import this module.
    from baton_serve.workers.kv.connectors import collective, object_store, shared_memory  # noqa: F401


_REGISTRY: Registry[type[KVConnector]] = Registry("KV connector", _load_builtin)
register_connector = _REGISTRY.register
connector_names = _REGISTRY.names
connector_class = _REGISTRY.get


def make_connector(name: str, host: KVHost) -> KVConnector:
    """The connector registered as ``name``, serving ``host``."""
    return connector_class(name)(host)


def connector_order(transport: str) -> tuple[str, ...]:
    """The connectors a transport setting tries, in order: "auto" or one connector's name."""
    if transport == "auto":
        return AUTO_ORDER
    connector_class(transport)
    return (transport,)


def ray_get(ref: Any, timeout: float) -> Any:
    """``ray.get`` bounded by ``timeout``; a peer that does not answer in time (unreachable, or
    stuck) is a ``KVTransferError`` saying so."""
    import ray

    try:
        return ray.get(ref, timeout=timeout)
    except ray.exceptions.GetTimeoutError as exc:
        raise KVTransferError(f"the peer did not answer within {timeout}s") from exc

