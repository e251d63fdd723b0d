"""KV between workers on one machine: the decode worker maps the prefill worker's cache, which
lives in shared memory or, on a GPU, behind a CUDA IPC handle (``workers.kv.shared``), and copies
the blocks out of it in its own turn at the cores: one RPC and one copy per request, no socket, no
second buffer. Two workers on one GPU have no other way: NCCL refuses two ranks on one device."""

from __future__ import annotations

import logging
import time
from typing import Any

from baton_serve.workers.errors import OutOfBlocksError
from baton_serve.workers.kv.connector import KVConnector, KVShipment, ray_get, register_connector
from baton_serve.workers.kv.migration import MigrationMeta
from baton_serve.workers.kv.shared import KVExport, export_alive, map_export
from baton_serve.workers.kv.transfer import KVTransferError
from baton_serve.workers.node import node_id

log = logging.getLogger("baton.kv")


@register_connector
class SharedMemoryConnector(KVConnector):
    """Reaches a peer only when it runs on this Ray node and could map our exported cache (same
    machine and PID namespace, /proc lets it open our descriptor, and for a GPU cache it sees our
    GPU); asked once per peer. Two Ray nodes on one machine (network namespaces, containers)
    never share: KV between nodes goes over the network, as it would between machines."""

    name = "shared_memory"
    needs_shared_cache = True

    def __init__(self, host: Any) -> None:
        super().__init__(host)
        export = host.core.runner.kv_export  # set on a prefill worker whose cache is shared
        self._export = export.to_dict() if export is not None else None
        self._node = node_id()
        self._reaches: dict[str, bool] = {}  # decode peer id -> it maps our cache (prefill side)
        self._mapped: dict[str, tuple[KVExport, list[Any]]] = {}  # prefill peer -> its mapped cache

    # ------------------------------------------------------------------ prefill side
    def reaches(self, peer_id: str, peer: Any) -> bool:
        if self._export is None:
            return False
        same = self._reaches.get(peer_id)
        if same is None:
            offer = {"export": self._export, "node_id": self._node}
            same = bool(ray_get(peer.kv_accept.remote(self.name, self.host.worker_id, offer),
                                self.host.kv_timeout_s))
            self._reaches[peer_id] = same
            if not same:
                log.info("decode worker %s cannot map this worker's KV cache", peer_id)
        return same

    def send(self, peer_id: str, peer: Any, shipment: KVShipment) -> int:
        host, meta = self.host, shipment.meta
        started = time.perf_counter()
        nbytes = self.until_room(meta, lambda front: peer.kv_receive.remote(
            self.name, host.worker_id, shipment.member_id, None,
            {"meta": meta.to_dict(), "front_id": front, "source_table": shipment.table, "export": self._export}))
        host.transfer.record_transfer(nbytes, time.perf_counter() - started)  # the peer did the copy
        return nbytes

    def abandon(self, peer_id: str, peer: Any, shipment: KVShipment) -> None:
        # It may be reading our blocks: they are freed only once it has let go.
        try:
            ray_get(peer.kv_cancel.remote(shipment.member_id, shipment.meta.index), self.host.kv_timeout_s)
        except Exception as exc:
            log.warning("withdrawing %s from %s failed: %r", shipment.member_id, peer_id, exc)

    # ------------------------------------------------------------------ decode side
    def accept(self, peer_id: str, info: dict[str, Any]) -> bool:
        """Map a prefill peer's exported cache now (``info``: its export and Ray node id); False
        when it cannot be (another node, another machine, /proc closed to this process), and the
        peer then uses another connector."""
        if self.host.tp_size > 1:  # our rank 0 holds only its KV heads: the ranks take theirs over the network
            log.info("KV from %s goes rank to rank: this worker is tensor-parallel", peer_id)
            return False
        if info.get("node_id") != self._node:
            log.info("prefill worker %s is on another Ray node: its KV comes over the network", peer_id)
            return False
        try:
            self._peer_cache(peer_id, KVExport.from_dict(info["export"]))
        except KVTransferError as exc:
            log.info("cannot map the KV cache of %s: %s", peer_id, exc)
            return False
        return True

    def receive(self, peer_id: str, member_id: str, blocks: list[int] | None, payload: Any) -> int | None:
        """In this worker's next turn at the cores: reserve blocks, copy the KV out of the sender's
        mapped cache, admit. None when full now (the sender retries)."""
        host = self.host
        m = MigrationMeta(**payload["meta"])
        if host.refuses(m.request_id):
            raise KVTransferError(f"request {m.request_id} was aborted")
        source = self._peer_cache(peer_id, KVExport.from_dict(payload["export"]))
        source_table = payload["source_table"]
        host.register(m.request_id, payload["front_id"], m.index)

        def copy_in(engine: Any) -> int | None:
            if host.take_withdrawn(m.member_id):  # its sender gave up meanwhile
                host.forget_sample(m.request_id, m.index)  # registered above: it will not decode here
                raise KVTransferError(f"{m.member_id} was withdrawn by its sender")
            try:
                needed = engine.reserve_remote(m)
            except OutOfBlocksError:
                return None
            table = engine.incoming_block_table(m.member_id)
            try:
                nbytes = host.transfer.copy_blocks_from(source, [source_table[i] for i in needed],
                                                        [table[i] for i in needed])
                self.check_received(m.member_id)
            except BaseException:
                engine.cancel_remote(m.member_id)
                raise
            host.admit_here(engine, m.member_id)
            return nbytes

        try:
            return host.engine.call_in_turn(copy_in, timeout=host.kv_timeout_s)
        except TimeoutError as exc:
            raise KVTransferError(f"no turn at the cores for {m.member_id} within {host.kv_timeout_s}s") from exc

    def _peer_cache(self, peer_id: str, export: KVExport) -> list[Any]:
        """The sender's cache, mapped once per export (a restarted peer exports anew)."""
        held = self._mapped.get(peer_id)
        if held is None or held[0].token != export.token:
            held = self._mapped[peer_id] = (export, map_export(export))
        return held[1]

    # ------------------------------------------------------------------ both
    def peers_changed(self, peers: dict[str, Any]) -> None:
        for gone in set(self._reaches) - set(peers):
            self._reaches.pop(gone, None)
        for gone in set(self._mapped) - set(peers):  # unmap: a dead peer's memory is freed
            self._mapped.pop(gone, None)

    def stats(self) -> dict[str, Any]:
        for peer_id, (export, _) in list(self._mapped.items()):
            if not export_alive(export):  # its worker died: let the kernel free that memory
                self._mapped.pop(peer_id, None)
        return {"mapped_peer_caches": len(self._mapped)}

    def close(self) -> None:
        self._mapped.clear()
