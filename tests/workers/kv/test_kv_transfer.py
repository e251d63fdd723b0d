"""KV transfer: real gloo pair groups between spawned processes, the object-store transport,
failure paths (header mismatch, dead/silent peer, missing peer) and loopback-only binding."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import torch
import torch.multiprocessing as mp
from baton_serve.workers.errors import BatonError, KVTransferError
from baton_serve.workers.kv.transfer import (
    KVTransferEngine,
    KVTransferRejected,
    PairGroup,
    PairRendezvous,
    transfer_key,
)

torch.set_num_threads(1)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# 3 layers, 12 blocks of 4 tokens, 2 KV heads (GQA: fewer than the query heads), head dim 16.
SPEC = {"layers": 3, "blocks": 12, "block_size": 4, "heads": 2, "head_dim": 16}
SRC_IDS, DST_IDS = [1, 7, 3, 10], [9, 0, 4, 5]  # non-contiguous, unsorted, different on each side
POISON = -7.0


def make_caches(spec: dict[str, Any], dtype: str, seed: int | None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Deterministic random caches (``seed``) or caches filled with ``POISON`` (``seed=None``)."""
    shape = (spec["blocks"], spec["block_size"], spec["heads"], spec["head_dim"])
    gen = torch.Generator().manual_seed(seed or 0)

    def one() -> torch.Tensor:
        if seed is None:
            return torch.full(shape, POISON, dtype=DTYPES[dtype])
        return torch.randn(shape, generator=gen).to(DTYPES[dtype])

    return [(one(), one()) for _ in range(spec["layers"])]


def stacked(caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """``[layers, 2, blocks, block_size, H, D]``."""
    return torch.stack([torch.stack(kv) for kv in caches])


def bits(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(-1).view(torch.uint8).numpy()


def expected_dst(dtype: str, src_ids: list[int], dst_ids: list[int]) -> np.ndarray:
    src, dst = stacked(make_caches(SPEC, dtype, 1)), stacked(make_caches(SPEC, dtype, None))
    dst[:, :, dst_ids] = src[:, :, src_ids]
    return bits(dst)


# -- a tiny actor: a spawned process running commands from a pipe ----------------------------


def _cmd_listen(state: dict, timeout_s: float) -> dict:
    state["group"] = PairGroup()
    return state["group"].listen(timeout_s=timeout_s).to_dict()


def _cmd_join(state: dict, rdv: dict, rank: int) -> float:
    if rank == 1:
        state["group"] = PairGroup()
    start = time.perf_counter()
    state["group"].join(PairRendezvous.from_dict(rdv), rank)
    return time.perf_counter() - start


def _cmd_caches(state: dict, spec: dict, dtype: str, seed: int | None) -> None:
    state["caches"] = make_caches(spec, dtype, seed)
    state["engine"] = KVTransferEngine(state["caches"], spec["block_size"], "cpu")


def _cmd_send(state: dict, ids: list[int], transfer_id: int, per_layer: bool) -> int:
    return state["engine"].send_blocks(state["group"], ids, transfer_id=transfer_id, per_layer=per_layer)


def _cmd_recv(state: dict, ids: list[int], transfer_id: int) -> int:
    return state["engine"].recv_blocks(state["group"], ids, transfer_id=transfer_id)


def _cmd_dump(state: dict) -> np.ndarray:
    return bits(stacked(state["caches"]))


def _cmd_close(state: dict) -> None:
    state.pop("group").close()


def _cmd_listening(state: dict) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket this process listens on, from /proc."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        with_target = os.readlink(f"/proc/self/fd/{fd}") if os.path.exists(f"/proc/self/fd/{fd}") else ""
        if with_target.startswith("socket:["):
            inodes.add(with_target[8:-1])
    found = []
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if cols[3] == "0A" and cols[9] in inodes:  # 0A = LISTEN
                    addr, port = cols[1].split(":")
                    found.append((_decode_addr(addr), int(port, 16)))
    return found


def _decode_addr(hex_addr: str) -> str:
    raw = bytes.fromhex(hex_addr)
    if len(raw) == 4:
        return socket.inet_ntop(socket.AF_INET, raw[::-1])
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))
    return socket.inet_ntop(socket.AF_INET6, words)


def _cmd_throughput(state: dict, role: str, nbytes: int, iters: int) -> list[float]:
    """Ping-pong: the sender times ``nbytes`` of fp16 out plus an 8-byte ack back."""
    group, buf = state["group"], torch.full((nbytes // 2,), 1.5, dtype=torch.float16)
    ack, times = torch.zeros(1, dtype=torch.int64), []
    for _ in range(iters + 1):  # the first round is a warm-up (page faults, connections)
        start = time.perf_counter()
        if role == "send":
            group.send(buf, 9)
            group.recv(ack, 10)
        else:
            group.recv(buf, 9)
            group.send(ack, 10)
        times.append(time.perf_counter() - start)
    return times[1:]


def _cmd_exit(state: dict) -> None:
    os._exit(0)


_COMMANDS = {name[5:]: fn for name, fn in globals().items() if name.startswith("_cmd_")}


def _peer_main(conn: Any) -> None:
    torch.set_num_threads(1)
    state: dict = {}
    while True:
        try:
            cmd, args = conn.recv()
        except EOFError:
            return
        try:
            reply = ("ok", _COMMANDS[cmd](state, *args))
        except Exception as exc:  # shipped back to the test process
            reply = ("error", (type(exc).__name__, str(exc), isinstance(exc, KVTransferError)))
        conn.send(reply)


class RemoteError(Exception):
    def __init__(self, type_name: str, message: str, is_kv: bool) -> None:
        super().__init__(f"{type_name}: {message}")
        self.type_name, self.is_kv = type_name, is_kv


class Peer:
    """One spawned process; ``submit`` then ``result`` so two peers can block concurrently."""

    def __init__(self, name: str) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_peer_main, args=(child,), name=name, daemon=True)
        self.proc.start()
        child.close()

    def submit(self, cmd: str, *args: Any) -> None:
        self.conn.send((cmd, args))

    def result(self, timeout: float = 60.0) -> Any:
        if not self.conn.poll(timeout):
            raise TimeoutError(f"{self.proc.name}: no reply within {timeout}s")
        kind, value = self.conn.recv()
        if kind == "error":
            raise RemoteError(*value)
        return value

    def call(self, cmd: str, *args: Any) -> Any:
        self.submit(cmd, *args)
        return self.result()

    def stop(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(10)


def outcome(peer: Peer) -> Any:
    try:
        return peer.result()
    except RemoteError as exc:
        return exc


def start_pair(timeout_s: float) -> tuple[Peer, Peer]:
    prefill, decode = Peer("prefill"), Peer("decode")
    rdv = prefill.call("listen", timeout_s)
    rdv = msgpack.unpackb(msgpack.packb(rdv))  # it must survive msgpack (a Ray call)
    decode.submit("join", rdv, 1)  # rank 1 first: join order must not matter
    prefill.submit("join", rdv, 0)
    decode.result(), prefill.result()
    return prefill, decode


def transfer(prefill: Peer, decode: Peer, src: list[int], dst: list[int], transfer_id: int = 0,
             per_layer: bool = False, recv_id: int | None = None) -> tuple[Any, Any]:
    decode.submit("recv", dst, transfer_id if recv_id is None else recv_id)
    prefill.submit("send", src, transfer_id, per_layer)
    return outcome(prefill), outcome(decode)


@pytest.fixture(scope="module")
def pair() -> Any:
    prefill, decode = start_pair(timeout_s=30.0)
    yield prefill, decode
    for peer in (prefill, decode):
        peer.stop()


# -- tests ------------------------------------------------------------------------------------


def test_error_type() -> None:
    assert issubclass(KVTransferError, BatonError) and issubclass(KVTransferRejected, KVTransferError)


def test_listen_binds_loopback_only_and_close_releases_the_port() -> None:
    group = PairGroup()
    rdv = group.listen(timeout_s=5.0)
    assert group.bound_address == ("127.0.0.1", rdv.port) and rdv.host == "127.0.0.1"
    assert PairRendezvous.from_dict(msgpack.unpackb(msgpack.packb(rdv.to_dict()))) == rdv
    assert [a for a, p in _cmd_listening({}) if p == rdv.port] == ["127.0.0.1"]
    group.close()
    group.close()  # idempotent
    assert group.bound_address is None
    assert not [a for a, p in _cmd_listening({}) if p == rdv.port]


def test_joined_pair_listens_on_loopback_only(pair: tuple[Peer, Peer]) -> None:
    for peer in pair:
        addrs = {a for a, _ in peer.call("listening")}
        assert addrs <= {"127.0.0.1", "::ffff:127.0.0.1"}, addrs


@pytest.mark.parametrize("per_layer", [False, True], ids=["whole", "per_layer"])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_blocks_arrive_bit_identical(pair: tuple[Peer, Peer], dtype: str, per_layer: bool) -> None:
    prefill, decode = pair
    prefill.call("caches", SPEC, dtype, 1)
    decode.call("caches", SPEC, dtype, None)
    tid = transfer_key(f"req-{dtype}-{per_layer}")
    sent, received = transfer(prefill, decode, SRC_IDS, DST_IDS, tid, per_layer)
    nbytes = len(SRC_IDS) * 2 * SPEC["layers"] * 4 * 2 * 16 * DTYPES[dtype].itemsize
    assert sent == received == nbytes
    # moved blocks equal the source bit for bit; every other block kept its poison
    np.testing.assert_array_equal(decode.call("dump"), expected_dst(dtype, SRC_IDS, DST_IDS))
    np.testing.assert_array_equal(prefill.call("dump"), bits(stacked(make_caches(SPEC, dtype, 1))))


def test_header_mismatch_is_rejected_and_nothing_scattered(pair: tuple[Peer, Peer]) -> None:
    prefill, decode = pair
    prefill.call("caches", SPEC, "bfloat16", 1)
    decode.call("caches", SPEC, "bfloat16", None)
    poison = decode.call("dump")
    cases = [  # (sender ids, receiver ids, receiver's transfer id, the field named)
        (SRC_IDS, DST_IDS[:3], 5, "num_blocks"),
        (SRC_IDS, DST_IDS, 6, "transfer_id"),
        ([1, 1, 2, 3], DST_IDS, 5, "num_blocks"),  # sender's ids invalid: still a clean reject
        (SRC_IDS, [0, 1, 2, 99], 5, "receiver block ids"),
    ]
    for src, dst, recv_id, field in cases:
        sent, received = transfer(prefill, decode, src, dst, 5, recv_id=recv_id)
        for err in (sent, received):
            assert isinstance(err, RemoteError) and err.type_name == "KVTransferRejected", err
        assert field in str(received), received
        np.testing.assert_array_equal(decode.call("dump"), poison)
    decode.call("caches", SPEC, "float16", None)  # dtype differs from the sender's bf16
    _, received = transfer(prefill, decode, SRC_IDS, DST_IDS, 5)
    assert isinstance(received, RemoteError) and "dtype" in str(received)
    # a rejection leaves the group usable
    decode.call("caches", SPEC, "bfloat16", None)
    assert transfer(prefill, decode, SRC_IDS, DST_IDS, 8)[1] > 0
    np.testing.assert_array_equal(decode.call("dump"), expected_dst("bfloat16", SRC_IDS, DST_IDS))


def test_silent_then_dead_peer_fail_within_the_timeout() -> None:
    timeout_s = 3.0
    prefill, decode = start_pair(timeout_s)
    try:
        for peer, seed in ((prefill, 1), (decode, None)):
            peer.call("caches", SPEC, "float32", seed)
        # alive but never sends: the receiver times out, it does not hang
        start = time.perf_counter()
        err = outcome_of(decode, "recv", DST_IDS, 0)
        elapsed = time.perf_counter() - start
        assert isinstance(err, RemoteError) and err.is_kv, err
        # bounded, not hung: a loaded 2-core machine (Ray processes of earlier tests still exiting) was seen at +5 s
        assert timeout_s - 0.5 <= elapsed < timeout_s + 8.0, elapsed
        # the failed group is broken: close both ends and meet again on a fresh one
        decode.call("close")
        prefill.call("close")
        rdv = prefill.call("listen", timeout_s)
        prefill.submit("join", rdv, 0)
        decode.submit("join", rdv, 1)
        prefill.result(), decode.result()
        # the sender dies before sending: the receiver fails fast (connection reset)
        start = time.perf_counter()
        decode.submit("recv", DST_IDS, 0)
        time.sleep(0.3)
        os.kill(prefill.proc.pid, signal.SIGKILL)
        err = outcome(decode)
        elapsed = time.perf_counter() - start
        assert isinstance(err, RemoteError) and err.is_kv, err
        assert elapsed < timeout_s, (elapsed, err)  # a reset connection, not the timeout
    finally:
        prefill.stop()
        decode.stop()


def outcome_of(peer: Peer, cmd: str, *args: Any) -> Any:
    peer.submit(cmd, *args)
    return outcome(peer)


def test_join_without_peer_times_out() -> None:
    group = PairGroup()
    rdv = group.listen(timeout_s=1.5)
    start = time.perf_counter()
    with pytest.raises(KVTransferError, match="could not join"):
        group.join(rdv, 0)
    assert 1.0 <= time.perf_counter() - start < 6.0
    assert group.bound_address is None and not group.usable  # a failed join closes the group
    with pytest.raises(KVTransferError):
        PairGroup().join(rdv, 0)  # rank 0 only joins what its own listen() returned
    # rank 1 with nobody listening (the port was just released)
    start = time.perf_counter()
    with pytest.raises(KVTransferError, match="could not join"):
        PairGroup().join(PairRendezvous("127.0.0.1", rdv.port, "nobody", "gloo", 1.0), 1)
    assert time.perf_counter() - start < 6.0


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_pack_unpack_roundtrip(dtype: str) -> None:
    src = KVTransferEngine(make_caches(SPEC, dtype, 1), SPEC["block_size"], "cpu")
    dst_caches = make_caches(SPEC, dtype, None)
    dst = KVTransferEngine(dst_caches, SPEC["block_size"], "cpu")
    array = src.pack_blocks(SRC_IDS)
    assert array.shape == src.buffer_shape(len(SRC_IDS))
    array.setflags(write=False)  # as it arrives from the Ray object store
    with pytest.raises(KVTransferError):
        dst.unpack_blocks(DST_IDS[:3], array)
    with pytest.raises(KVTransferError):
        dst.unpack_blocks(DST_IDS, array.view(np.uint8))
    np.testing.assert_array_equal(bits(stacked(dst_caches)), bits(stacked(make_caches(SPEC, dtype, None))))
    assert dst.unpack_blocks(DST_IDS, array) == array.nbytes
    np.testing.assert_array_equal(bits(stacked(dst_caches)), expected_dst(dtype, SRC_IDS, DST_IDS))
    assert src.stats.transfers == 1 and src.stats.bytes == array.nbytes
    assert dst.stats.transfers == 1 and dst.stats.failures == 2


def test_gloo_throughput_64mib(pair: tuple[Peer, Peer]) -> None:
    prefill, decode = pair
    nbytes = 64 << 20
    decode.submit("throughput", "recv", nbytes, 3)
    prefill.submit("throughput", "send", nbytes, 3)
    decode.result()
    raw = statistics.median(prefill.result())
    # the same 64 MiB through send_blocks: 2 layers x 1024 blocks x 16 tokens x 8 heads x 64 fp16
    spec = {"layers": 2, "blocks": 1024, "block_size": 16, "heads": 8, "head_dim": 64}
    prefill.call("caches", spec, "float16", 3)
    decode.call("caches", spec, "float16", None)
    ids = list(range(1024))
    transfer(prefill, decode, ids, ids)  # warm-up
    start = time.perf_counter()
    sent, _ = transfer(prefill, decode, ids, ids, per_layer=False)
    whole = time.perf_counter() - start
    start = time.perf_counter()
    transfer(prefill, decode, ids, ids, per_layer=True)
    layered = time.perf_counter() - start
    assert sent == nbytes
    gib = nbytes / (1 << 30)
    print(f"\ngloo 64 MiB fp16: raw send+ack {raw * 1e3:.1f} ms = {gib / raw:.2f} GiB/s; "
          f"send_blocks whole {whole * 1e3:.1f} ms = {gib / whole:.2f} GiB/s, "
          f"per-layer {layered * 1e3:.1f} ms = {gib / layered:.2f} GiB/s (incl. gather/scatter)")


class _RayWorker:
    """A stand-in for the Worker actor: one cache, one pair group."""

    def __init__(self, dtype: str, seed: int | None) -> None:
        torch.set_num_threads(1)
        self.state: dict = {}
        _cmd_caches(self.state, SPEC, dtype, seed)

    def call(self, cmd: str, *args: Any) -> Any:
        return _COMMANDS[cmd](self.state, *args)

    def pack(self, ids: list[int]) -> np.ndarray:
        return self.state["engine"].pack_blocks(ids)

    def unpack(self, ids: list[int], array: np.ndarray) -> int:
        return self.state["engine"].unpack_blocks(ids, array)


def test_ray_actors_gloo_and_object_store(monkeypatch: pytest.MonkeyPatch) -> None:
    ray = pytest.importorskip("ray")
    here = Path(__file__).resolve()
    monkeypatch.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    # actors unpickle _RayWorker by module name: put this file's folder and the repo on their path
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(here.parent), str(here.parents[3])]))
    temp_dir = tempfile.mkdtemp(prefix="rkv")  # short: Ray's socket paths live under it
    if ray.is_initialized():  # another module's instance lacks this test's PYTHONPATH
        ray.shutdown()
    ray.init(address="local", num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1",
             object_store_memory=256 << 20, _temp_dir=temp_dir)
    try:
        actor = ray.remote(num_cpus=0, max_concurrency=2)(_RayWorker)
        prefill, decode = actor.remote("bfloat16", 1), actor.remote("bfloat16", None)
        rdv = ray.get(prefill.call.remote("listen", 20.0))
        ray.get([prefill.call.remote("join", rdv, 0), decode.call.remote("join", rdv, 1)], timeout=60)
        sent, received = ray.get([prefill.call.remote("send", SRC_IDS, 1, True),
                                  decode.call.remote("recv", DST_IDS, 1)], timeout=60)
        assert sent == received > 0
        np.testing.assert_array_equal(ray.get(decode.call.remote("dump")),
                                      expected_dst("bfloat16", SRC_IDS, DST_IDS))
        # object-store transport: the ref resolves to a read-only numpy array in the decode actor
        moved = [2, 11]
        ray.get(decode.unpack.remote(moved, prefill.pack.remote(moved)), timeout=60)
        want = torch.from_numpy(expected_dst("bfloat16", SRC_IDS, DST_IDS).copy()).view(torch.bfloat16)
        want = want.view(SPEC["layers"], 2, SPEC["blocks"], 4, 2, 16)
        want[:, :, moved] = stacked(make_caches(SPEC, "bfloat16", 1))[:, :, moved]
        np.testing.assert_array_equal(ray.get(decode.call.remote("dump")), bits(want))
    finally:
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q", "-s"]))
