"""KV over a ``torch.distributed`` pair group per prefill/decode pair (gloo on CPUs, NCCL on GPUs):
the decode worker reserves, then the blocks go header, verdict, data, ack (``workers.kv.transfer``).

Where either side is tensor-parallel, KV moves rank to rank (resharding): one pair group per
route of ``workers.parallel.kv_routes``, each prefill rank sending its heads to the decode rank
that holds them, all routes at once, driven by the two rank 0s (``workers.parallel.kv_agent``).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from baton_serve.kernels import openmp
from baton_serve.workers.kv.connector import KVConnector, KVShipment, ray_get, register_connector
from baton_serve.workers.kv.pair_group import KVTransferRejected, PairGroup, PairRendezvous
from baton_serve.workers.kv.transfer import transfer_key
from baton_serve.workers.parallel.kv_routes import KVRoute, reshard_routes


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
        self._layouts: dict[str, dict[str, int]] = {}  # peer -> its kv_layout (prefill side)
        self._routes: dict[str, dict[str, KVRoute]] = {}  # peer -> joined route pairs, by key (prefill side)
        self._accepted: dict[str, list[tuple[int, str]]] = {}  # peer -> (our rank, key) joined (decode side)
        self._ranks = ThreadPoolExecutor(max_workers=16, thread_name_prefix="kv-ranks",
                                         initializer=openmp.serial_here)

    # ------------------------------------------------------------------ prefill side
    def send(self, peer_id: str, peer: Any, shipment: KVShipment) -> int:
        meta, host = shipment.meta, self.host
        needed, dst = self.until_room(meta, lambda front: peer.kv_reserve.remote(self.name, meta.to_dict(), front,
                                                                                 host.worker_id))
        blocks = [shipment.table[i] for i in needed]
        if host.tp_size > 1 or self._layout(peer_id, peer)["tp"] > 1:
            with self._lock(peer_id):
                return self._send_resharded(peer_id, peer, shipment, needed, blocks, dst)
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

    def _layout(self, peer_id: str, peer: Any) -> dict[str, int]:
        layout = self._layouts.get(peer_id)
        if layout is None:
            layout = self._layouts[peer_id] = ray_get(peer.kv_layout.remote(), self.host.kv_timeout_s)
        return layout

    def _send_resharded(self, peer_id: str, peer: Any, shipment: KVShipment, needed: list[int],
                        blocks: list[int], dst: list[int]) -> int:
        """Every route at once: each source rank sends its heads of ``blocks`` to its decode rank."""
        host, timeout = self.host, self.host.kv_timeout_s
        meta = shipment.meta
        routes = reshard_routes(host.num_kv_heads, host.tp_size, self._layout(peer_id, peer)["tp"])
        try:
            keys = self._route_pairs(peer_id, peer, routes)
            num_tokens = len(meta.prompt_token_ids) + len(meta.output_token_ids) - 1
            crcs: list[Any] = [None] * len(routes)
            if host.verify_kv and blocks:
                crcs = self._on_ranks([(host.tp_agents[r.src_rank], "crcs", {
                    "blocks": blocks, "heads": list(r.src_heads), "num_tokens": num_tokens, "logical": needed})
                    for r in routes])
            plan = [{"key": key, "dst_rank": r.dst_rank, "heads": list(r.dst_heads),
                     "expect": [[d, i, c] for d, i, c in zip(dst, needed, crc)] if crc is not None else None}
                    for key, r, crc in zip(keys, routes, crcs)]
            ref = peer.kv_receive.remote(self.name, host.worker_id, shipment.member_id, dst,
                                         {"routes": plan, "num_tokens": num_tokens})
            if host.faults.fire("stall_kv_send"):
                time.sleep(3 * timeout)
            started = time.perf_counter()
            tid = transfer_key(shipment.member_id)
            sent = self._on_ranks([(host.tp_agents[r.src_rank], "send", {
                "key": key, "blocks": blocks, "heads": list(r.src_heads), "transfer_id": tid,
                "per_layer": len(blocks) >= 16}) for key, r in zip(keys, routes)])
            ray_get(ref, timeout)
        except KVTransferRejected:
            raise
        except BaseException:
            self._drop_routes(peer_id)  # whatever failed mid-transfer, the pairs are out of step
            raise
        nbytes = sum(sent)
        host.transfer.record_transfer(nbytes, time.perf_counter() - started)
        return nbytes

    def _route_pairs(self, peer_id: str, peer: Any, routes: list[KVRoute]) -> list[str]:
        """One joined pair group per route (its key), opened the first time: each source rank
        listens, the peer's ranks join."""
        host = self.host
        keys = [f"{host.worker_id}>{peer_id}:{r.src_rank}>{r.dst_rank}" for r in routes]
        if set(keys) <= set(self._routes.get(peer_id, {})):
            return keys
        self._drop_routes(peer_id)
        timeout = host.kv_timeout_s
        rendezvous = self._on_ranks([(host.tp_agents[r.src_rank], "listen", {"key": key, "timeout_s": timeout})
                                     for key, r in zip(keys, routes)])
        joins = [self._ranks.submit(host.tp_agents[r.src_rank].call, "join", timeout, key=key, rank=0)
                 for key, r in zip(keys, routes)]
        self._routes[peer_id] = dict(zip(keys, routes))  # dropped on failure: close what listened
        offer = {"routes": [{"key": key, "dst_rank": r.dst_rank, "rendezvous": rdv}
                            for key, r, rdv in zip(keys, routes, rendezvous)]}
        ray_get(peer.kv_accept.remote(self.name, host.worker_id, offer), timeout)
        for join in joins:
            join.result(timeout)
        return keys

    def _drop_routes(self, peer_id: str) -> None:
        for key, route in self._routes.pop(peer_id, {}).items():
            try:
                self.host.tp_agents[route.src_rank].call("close_pair", self.host.kv_timeout_s, key=key)
            except Exception:  # noqa: BLE001 - a rank that is gone has nothing left to close
                pass

    def _on_ranks(self, calls: list[tuple[Any, str, dict[str, Any]]]) -> list[Any]:
        """Run ``agent.call(op, **args)`` for each, in parallel; their results in order, or the
        first failure once every call has ended (none is left running on a pair)."""
        timeout = self.host.kv_timeout_s
        futures = [self._ranks.submit(agent.call, op, timeout, **args) for agent, op, args in calls]
        results, error = [], None
        for future in futures:
            try:
                results.append(future.result(timeout + 5))
            except BaseException as exc:  # noqa: BLE001 - raised below, after the others ended
                error = error or exc
                results.append(None)
        if error is not None:
            raise error
        return results

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
        """Join ``peer_id``'s new pair group as rank 1 (replacing any previous one); with
        ``routes``, each of our ranks joins the pair groups of its routes."""
        if "routes" in info:
            self._close_accepted(peer_id)
            routes = info["routes"]
            self._accepted[peer_id] = [(r["dst_rank"], r["key"]) for r in routes]
            self._on_ranks([(self.host.tp_agents[r["dst_rank"]], "join",
                             {"key": r["key"], "rank": 1, "rendezvous": r["rendezvous"]}) for r in routes])
            return True
        self._drop(peer_id)
        group = PairGroup(self.host.core.runner.device)
        group.join(PairRendezvous.from_dict(info), rank=1)
        self._pairs[peer_id] = group
        return True

    def receive(self, peer_id: str, member_id: str, blocks: list[int] | None, payload: Any) -> int:
        openmp.serial_here()  # a Ray thread: a team of its own would throttle the engine's
        host = self.host
        if isinstance(payload, dict) and "routes" in payload:
            return self._receive_resharded(peer_id, member_id, blocks or [], payload)
        try:
            nbytes = host.transfer.recv_blocks(self._pairs[peer_id], blocks or [],
                                               transfer_id=transfer_key(member_id))
            self.check_received(member_id)
        except Exception:
            host.engine.submit(lambda e: e.cancel_remote(member_id))
            raise
        host.admit(member_id)
        return nbytes

    def _receive_resharded(self, peer_id: str, member_id: str, blocks: list[int], payload: dict[str, Any]) -> int:
        """Each of our ranks takes its routes' heads into ``blocks`` and checks them; then admit."""
        host = self.host
        started = time.perf_counter()
        corrupt = host.faults.fire("corrupt_received_kv")
        tid = transfer_key(member_id)
        try:
            got = self._on_ranks([(host.tp_agents[r["dst_rank"]], "recv", {
                "key": r["key"], "blocks": blocks, "heads": r["heads"], "transfer_id": tid, "expect": r["expect"],
                "num_tokens": payload["num_tokens"], "corrupt": corrupt and i == 0})
                for i, r in enumerate(payload["routes"])])
        except Exception:
            host.engine.submit(lambda e: e.cancel_remote(member_id))
            raise
        nbytes = sum(got)
        host.transfer.record_transfer(nbytes, time.perf_counter() - started)
        host.admit(member_id)
        return nbytes

    def _close_accepted(self, peer_id: str) -> None:
        for rank, key in self._accepted.pop(peer_id, []):
            try:
                self.host.tp_agents[rank].call("close_pair", self.host.kv_timeout_s, key=key)
            except Exception:  # noqa: BLE001 - a rank that is gone has nothing left to close
                pass

    # ------------------------------------------------------------------ both
    def peers_changed(self, peers: dict[str, Any]) -> None:
        for gone in set(self._pairs) - set(peers):
            self._drop(gone)
        for gone in (set(self._routes) | set(self._layouts)) - set(peers):
            self._layouts.pop(gone, None)
            self._drop_routes(gone)
        for gone in set(self._accepted) - set(peers):
            self._close_accepted(gone)

    def stats(self) -> dict[str, Any]:
        routes = sum(len(r) for r in self._routes.values()) + sum(len(a) for a in self._accepted.values())
        return {"pair_groups": len(self._pairs) + routes}

    def close(self) -> None:
        for peer_id in list(self._pairs):
            self._drop(peer_id)
        for peer_id in list(self._routes):
            self._drop_routes(peer_id)
        for peer_id in list(self._accepted):
            self._close_accepted(peer_id)
        self._ranks.shutdown(wait=False, cancel_futures=True)
