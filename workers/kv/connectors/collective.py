"""KV over a ``torch.distributed`` pair group per prefill/decode pair (gloo on CPUs, NCCL on GPUs):
the decode worker reserves, then the blocks go header, verdict, data, ack (``workers.kv.transfer``).
"""

from __future__ import annotations

import threading
import time
from typing import Any

from baton_serve.kernels import openmp
from baton_serve.workers.kv.connector import KVConnector, KVShipment, ray_get, register_connector
from baton_serve.workers.kv.pair_group import KVTransferRejected, PairGroup, PairRendezvous
from baton_serve.workers.kv.transfer import transfer_key


@register_connector
class CollectiveConnector(KVConnector):
    """One pair group per peer, created on first use (the sender listens as rank 0); a group
    broken by a failure is rebuilt for the next request."""

    name = "collective"

    def __init__(self, host: Any) -> None:
        super().__init__(host)
        self._pairs: dict[str, PairGroup] = {}
        self._locks: dict[str, threading.Lock] = {}
        self._locks_guard = threading.Lock()

    # ------------------------------------------------------------------ prefill side
    def send(self, peer_id: str, peer: Any, shipment: KVShipment) -> int:
        meta, host = shipment.meta, self.host
        needed, dst = self.until_room(meta, lambda front: peer.kv_reserve.remote(self.name, meta.to_dict(), front,
                                                                                 host.worker_id))
        blocks = [shipment.table[i] for i in needed]
        with self._lock(peer_id):
            group = self._pair(peer_id, peer)
            ref = peer.kv_receive.remote(self.name, host.worker_id, shipment.member_id, dst, None)
            if host.faults.fire("stall_kv_send"):
                time.sleep(3 * host.kv_timeout_s)
            try:
                # per-layer sends overlap the next gather with the wire; worth it past a few MB
                nbytes = host.transfer.send_blocks(group, blocks, transfer_id=transfer_key(shipment.member_id),
                                                   per_layer=len(blocks) >= 16)
            except KVTransferRejected:
                raise  # a refused header moved nothing: the stream is still in step
            except BaseException:
                group.mark_broken()  # whatever failed mid-transfer, the two sides are out of step
                raise
            ray_get(ref, host.kv_timeout_s)
        return nbytes

    def abandon(self, peer_id: str, peer: Any, shipment: KVShipment) -> None:
        super().abandon(peer_id, peer, shipment)
        # Only a broken group goes, and under the pair's lock: a shipment that failed before it
        # touched the group (its request aborted at the reservation) must not close the group
        # under the next request's transfer.
        with self._lock(peer_id):
            group = self._pairs.get(peer_id)
            if group is not None and not group.usable:
                self._drop(peer_id)

    def _lock(self, peer_id: str) -> threading.Lock:
        with self._locks_guard:
            return self._locks.setdefault(peer_id, threading.Lock())

    def _pair(self, peer_id: str, peer: Any) -> PairGroup:
        group = self._pairs.get(peer_id)
        if group is not None and not group.usable:  # broken by an earlier failure: start over
            self._drop(peer_id)
            group = None
        if group is None:
            host = self.host
            group = PairGroup(host.core.runner.device)
            rendezvous = group.listen(host=host.host, timeout_s=host.kv_timeout_s)
            ref = peer.kv_accept.remote(self.name, host.worker_id, rendezvous.to_dict())
            group.join(rendezvous, rank=0)
            ray_get(ref, host.kv_timeout_s)
            self._pairs[peer_id] = group
        return group

    def _drop(self, peer_id: str) -> None:
        group = self._pairs.pop(peer_id, None)
        if group is not None:
            group.close()

    # ------------------------------------------------------------------ decode side
    def accept(self, peer_id: str, info: dict[str, Any]) -> bool:
        """Join ``peer_id``'s new pair group as rank 1 (replacing any previous one)."""
        self._drop(peer_id)
        group = PairGroup(self.host.core.runner.device)
        group.join(PairRendezvous.from_dict(info), rank=1)
        self._pairs[peer_id] = group
        return True

    def receive(self, peer_id: str, member_id: str, blocks: list[int] | None, payload: Any) -> int:
        openmp.serial_here()  # a Ray thread: a team of its own would throttle the engine's
        host = self.host
        try:
            nbytes = host.transfer.recv_blocks(self._pairs[peer_id], blocks or [],
                                               transfer_id=transfer_key(member_id))
            self.check_received(member_id)
        except Exception:
            host.engine.submit(lambda e: e.cancel_remote(member_id))
            raise
        host.admit(member_id)
        return nbytes

    # ------------------------------------------------------------------ both
    def peers_changed(self, peers: dict[str, Any]) -> None:
        for gone in set(self._pairs) - set(peers):
            self._drop(gone)

    def stats(self) -> dict[str, Any]:
        return {"pair_groups": len(self._pairs)}

    def close(self) -> None:
        for peer_id in list(self._pairs):
            self._drop(peer_id)
