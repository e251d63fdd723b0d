"""The Worker's same-machine KV receive, called in-process (the Ray path is in tests/cluster)."""

from __future__ import annotations

import os
import socket
import time

import pytest
from baton_serve.workers import LLM, SamplingParams
from baton_serve.workers.actor.messages import decode_deltas, params_to_dict
from baton_serve.workers.actor.output_stream import frame, hello_payload, read_frame
from baton_serve.workers.actor.worker import Worker
from baton_serve.workers.errors import KVTransferError

NUM_BLOCKS = 64
PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def _parked(tiny_model_dir, prompt_text: str = "Hello world! How are you today?"):
    """A prefill engine with a shared cache holding one parked request: (llm, prompt, meta, table)."""
    llm = LLM(model=str(tiny_model_dir), dtype="float32", block_size=8, num_kv_blocks=NUM_BLOCKS,
              kv_cache_shared=True)
    prompt = llm.tokenizer.encode(prompt_text)
    llm.engine.add_request("r", prompt, PARAMS, prefill_only=True)
    while "r" not in llm.engine.parked:
        llm.engine.step()
    meta, table = llm.engine.migration_meta("r")
    return llm, prompt, meta, table


def _decode_worker(tiny_model_dir, num_blocks: int = NUM_BLOCKS) -> Worker:
    return Worker("decode-0", "decode", {"model": str(tiny_model_dir), "dtype": "float32", "block_size": 8,
                                         "num_kv_blocks": num_blocks})


def _shared_receive(worker: Worker, meta: dict, table: list[int], export: dict) -> int | None:
    """What a prefill worker on this machine sends: copy my sample's KV out of my cache."""
    return worker.kv_receive("shared_memory", "prefill-0", meta["member_id"], None,
                             {"meta": meta, "front_id": "f", "source_table": table, "export": export})


def _tokens(worker: Worker, front: str = "f") -> list[int]:
    toks: list[int] = []
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for d in decode_deltas(worker.poll(front, 0.2)):
            toks += d.token_ids
            if d.finish_reason:
                return toks
    raise AssertionError(f"no finish within 30 s; got {toks}")


def test_shared_receive_copies_admits_and_decodes_like_one_engine(tiny_model_dir):
    llm, prompt, meta, table = _parked(tiny_model_dir)
    worker = _decode_worker(tiny_model_dir)
    try:
        export = llm.engine.runner.kv_export.to_dict()
        nbytes = _shared_receive(worker, meta.to_dict(), table, export)
        assert nbytes == worker.transfer.stats.bytes > 0
        offline = LLM(model=str(tiny_model_dir), dtype="float32", block_size=8, num_kv_blocks=NUM_BLOCKS)
        assert meta.output_token_ids + _tokens(worker) == offline.generate([prompt], PARAMS)[0].outputs[0].token_ids
        assert worker.stats()["mapped_peer_caches"] == 1
        worker.set_peers({})  # the prefill worker left the pools: its cache is unmapped
        assert worker.stats()["mapped_peer_caches"] == 0
        _shared_receive(worker, {**meta.to_dict(), "request_id": "r2", "member_id": "r2"}, table, export)
        assert worker.stats()["mapped_peer_caches"] == 1
        os.close(llm.engine.runner.kv_export.fd)  # as when the prefill process dies
        assert worker.stats()["mapped_peer_caches"] == 0
    finally:
        worker.shutdown()


def test_a_withdrawn_transfer_is_refused_and_a_full_worker_answers_none(tiny_model_dir):
    llm, _, meta, table = _parked(tiny_model_dir)
    export = llm.engine.runner.kv_export.to_dict()
    worker = _decode_worker(tiny_model_dir)
    try:
        # what a prefill worker asks first: can you map my cache? (no: it ships over gloo instead)
        node = worker.info()["node_id"]  # None outside Ray: in-process here
        assert not worker.kv_accept("shared_memory", "prefill-0", {"export": {**export, "machine": "another-boot/1"},
                                                                   "node_id": node})
        assert not worker.kv_accept("shared_memory", "prefill-0", {"export": export, "node_id": "another-node"})
        assert worker.stats()["mapped_peer_caches"] == 0
        assert worker.kv_accept("shared_memory", "prefill-0", {"export": export, "node_id": node}) and worker.stats()["mapped_peer_caches"] == 1
        worker.kv_cancel(meta.member_id, meta.index)  # the sender gave up before the copy was queued
        with pytest.raises(KVTransferError, match="withdrawn"):
            _shared_receive(worker, meta.to_dict(), table, export)
        stats = worker.stats()
        assert stats["num_free_blocks"] == NUM_BLOCKS and stats["num_running"] == 0
        assert worker.transfer.stats.bytes == 0
        # the sender's retry is not mistaken for the withdrawn one
        assert _shared_receive(worker, meta.to_dict(), table, export) > 0
    finally:
        worker.shutdown()
    small = _decode_worker(tiny_model_dir, num_blocks=1)  # the prompt needs 2 blocks
    try:
        assert _shared_receive(small, meta.to_dict(), table, export) is None
        assert small.stats()["num_free_blocks"] == 1 and small.transfer.stats.bytes == 0
    finally:
        small.shutdown()


def _frames_until_finished(sock: socket.socket, first: bytes | None = None) -> list[int]:
    """Token ids read off a front's output stream until a delta finishes."""
    toks: list[int] = []
    batch = first
    while True:
        for d in decode_deltas(batch if batch is not None else read_frame(sock, 1 << 24)):
            toks += d.token_ids
            if d.finish_reason:
                return toks
        batch = None


def test_outputs_go_down_a_connected_front_stream_and_a_front_that_hangs_up_loses_its_requests(tiny_model_dir):
    worker = Worker("colocated-0", "colocated", {"model": str(tiny_model_dir), "dtype": "float32",
                                                  "block_size": 8, "num_kv_blocks": NUM_BLOCKS})
    try:
        prompt = worker.tokenizer.encode("Hello world! How are you today?")
        offline = LLM(model=str(tiny_model_dir), dtype="float32", block_size=8, num_kv_blocks=NUM_BLOCKS)
        want = offline.generate([prompt], PARAMS)[0].outputs[0].token_ids
        # Before the front connects, its outputs wait in its outbox ...
        worker.add_request("a", prompt, params_to_dict(PARAMS), front_id="f")
        deadline = time.monotonic() + 30
        while not any(d.finish_reason for d in worker._outboxes.get("f", [])):
            assert time.monotonic() < deadline
            time.sleep(0.02)
        # ... and come first on the stream, in the answer to its hello.
        info = worker.info()
        host, port = info["output_address"]
        sock = socket.create_connection((host, port), timeout=30)
        sock.sendall(frame(hello_payload("f", info["output_secret"])))
        assert _frames_until_finished(sock, read_frame(sock, 1 << 24)) == want
        worker.add_request("b", prompt, params_to_dict(PARAMS), front_id="f")
        assert _frames_until_finished(sock) == want
        assert decode_deltas(worker.poll("f", 0.0)) == []  # nothing went to the outbox meanwhile
        # A front whose stream closes is gone: its requests are aborted, their blocks freed, and
        # nothing piles up for it; a later request of that front is aborted too.
        sock.close()
        for rid in ("c", "d"):
            worker.add_request(rid, prompt, params_to_dict(SamplingParams(max_tokens=400, ignore_eos=True)),
                               front_id="f")
            deadline = time.monotonic() + 30
            while True:
                s = worker.stats()
                if (s["tracked_requests"] == s["num_running"] == s["num_waiting"] == 0
                        and s["num_free_blocks"] == NUM_BLOCKS):
                    break
                assert time.monotonic() < deadline, s
                time.sleep(0.02)
            assert s["num_decode_tokens_computed"] < 2 * (len(want) + 50)  # stopped long before 400 tokens
            assert not worker._outboxes.get("f")
        # another front is unaffected
        worker.add_request("e", prompt, params_to_dict(PARAMS), front_id="g")
        assert _tokens(worker, "g") == want
    finally:
        worker.shutdown()
    with pytest.raises(ConnectionRefusedError):  # shut down: it takes no more fronts
        socket.create_connection((host, port), timeout=5)


def test_an_add_that_comes_after_its_abort_is_answered_with_an_abort_not_run(tiny_model_dir):
    """Threaded actors reorder calls: an abort may overtake its add. The add must then not run,
    and must say so to its front (a silent drop left a stream that reused the id waiting for ever);
    a new id is served as usual."""
    worker = Worker("colocated-0", "colocated", {"model": str(tiny_model_dir), "dtype": "float32",
                                                 "block_size": 8, "num_kv_blocks": NUM_BLOCKS})
    try:
        worker.abort("late")
        worker.add_request("late", [5, 6, 7], params_to_dict(PARAMS), front_id="f")
        [delta] = decode_deltas(worker.poll("f", 5))
        assert (delta.request_id, delta.finish_reason) == ("late", "abort")
        assert "aborted moments ago" in delta.stop_reason
        worker.add_request("fresh", [5, 6, 7], params_to_dict(PARAMS), front_id="f")
        assert len(_tokens(worker)) == PARAMS.max_tokens
        stats = worker.stats()
        assert stats["num_free_blocks"] == NUM_BLOCKS and stats["tracked_requests"] == 0
    finally:
        worker.shutdown()


def test_listeners_bind_the_address_ray_knows_the_node_by(monkeypatch):
    """Output stream and pair-group rendezvous bind the node's routable address, so that fronts and
    peers on other nodes reach them; loopback only outside Ray (or when Ray itself is on it)."""
    import ray
    from baton_serve.workers.node import node_address

    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: "198.18.0.7")
    assert node_address() == "198.18.0.7"
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    assert node_address() == "127.0.0.1"


def _wait_free(worker: Worker, timeout_s: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        stats = worker.stats()
        if stats["num_free_blocks"] == NUM_BLOCKS and stats["tracked_requests"] == 0:
            return stats
        assert time.monotonic() < deadline, stats
        time.sleep(0.05)


@pytest.mark.parametrize("how", ["sender replaced", "never sent"])
def test_a_reservation_whose_sender_is_gone_is_freed_and_a_late_receive_refused(tiny_model_dir, how):
    """A prefill worker that reserved blocks here and died before sending: set_peers (its restart)
    frees them at once, and the periodic stats() call frees one that waited 3 KV timeouts."""
    _, _, meta, _ = _parked(tiny_model_dir)
    worker = Worker("decode-0", "decode", {"model": str(tiny_model_dir), "dtype": "float32", "block_size": 8,
                                           "num_kv_blocks": NUM_BLOCKS}, kv_timeout_s=0.2)
    try:
        first, restarted = object(), object()
        worker.set_peers({"prefill-0": first})
        got = worker.kv_reserve("collective", meta.to_dict(), "f", sender="prefill-0")
        assert got is not None and worker.stats()["num_free_blocks"] < NUM_BLOCKS
        if how == "sender replaced":
            worker.set_peers({"prefill-0": restarted})
        else:
            time.sleep(3 * 0.2 + 0.1)  # the next stats() call sweeps it
        _wait_free(worker)
        with pytest.raises(KVTransferError, match="freed"):
            worker.kv_receive("collective", "prefill-0", meta.member_id, [0], None)
    finally:
        worker.shutdown()


def test_a_reservation_with_a_live_sender_is_kept(tiny_model_dir):
    _, _, meta, _ = _parked(tiny_model_dir)
    worker = _decode_worker(tiny_model_dir)
    try:
        peer = object()
        worker.set_peers({"prefill-0": peer})
        assert worker.kv_reserve("collective", meta.to_dict(), "f", sender="prefill-0") is not None
        worker.set_peers({"prefill-0": peer, "prefill-1": object()})  # another peer came: nothing changes
        assert worker.stats()["num_free_blocks"] < NUM_BLOCKS
        worker.kv_cancel(meta.member_id, meta.index)  # the sender gave up: freed by the usual path
        _wait_free(worker)
    finally:
        worker.shutdown()
