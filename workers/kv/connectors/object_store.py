"""KV through Ray's object store: the sender packs the blocks into one array, the decode worker's
RPC receives it as an argument (zero-copy from the store on the same node)."""

from __future__ import annotations

from typing import Any

from baton_serve.kernels import openmp
from baton_serve.workers.errors import KVTransferError
from baton_serve.workers.kv.connector import KVConnector, KVShipment, ray_get, register_connector


@register_connector
class ObjectStoreConnector(KVConnector):
    """Reserve, then one RPC carrying the packed blocks: no pair group, no listener."""

    name = "object_store"

    def send(self, peer_id: str, peer: Any, shipment: KVShipment) -> int:
        meta, host = shipment.meta, self.host
        _one_cache(host)
        needed, dst = self.until_room(meta, lambda front: peer.kv_reserve.remote(self.name, meta.to_dict(), front,
                                                                                 self.host.worker_id))
        payload = host.transfer.pack_blocks([shipment.table[i] for i in needed])
        ray_get(peer.kv_receive.remote(self.name, host.worker_id, shipment.member_id, dst, payload),
                host.kv_timeout_s)
        return int(payload.nbytes)

    def receive(self, peer_id: str, member_id: str, blocks: list[int] | None, payload: Any) -> int:
        openmp.serial_here()
        try:
            _one_cache(self.host)
            self.host.transfer.unpack_blocks(blocks or [], payload)
            self.check_received(member_id)
        except Exception:
            self.host.engine.submit(lambda e: e.cancel_remote(member_id))
            raise
        self.host.admit(member_id)
        return int(getattr(payload, "nbytes", 0))


def _one_cache(host: Any) -> None:
    # One packed array per request holds one cache; a tensor-parallel replica has one per rank.
    if host.tp_size > 1:
        raise KVTransferError(f"the object_store connector moves one cache per worker; {host.worker_id} is "
                              f"tensor-parallel (tp={host.tp_size}): use the collective connector")
