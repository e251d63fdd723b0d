"""The Worker's same-machine KV receive, called in-process (the Ray path is in tests/cluster)."""

from __future__ import annotations

import os
import time

import pytest

from workers import LLM, SamplingParams
from workers.errors import KVTransferError
from workers.messages import decode_deltas
from workers.worker import Worker

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
        nbytes = worker.receive_kv_shared("prefill-0", meta.to_dict(), "f", table, export)
        assert nbytes == worker.transfer.stats.bytes > 0
        offline = LLM(model=str(tiny_model_dir), dtype="float32", block_size=8, num_kv_blocks=NUM_BLOCKS)
        assert meta.output_token_ids + _tokens(worker) == offline.generate([prompt], PARAMS)[0].outputs[0].token_ids
        assert worker.stats()["mapped_peer_caches"] == 1
        worker.set_peers({})  # the prefill worker left the pools: its cache is unmapped
        assert worker.stats()["mapped_peer_caches"] == 0
        worker.receive_kv_shared("prefill-0", {**meta.to_dict(), "request_id": "r2", "member_id": "r2"}, "f",
                                 table, export)
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
        assert not worker.map_peer_cache("prefill-0", {**export, "machine": "another-boot/1"})
        assert worker.stats()["mapped_peer_caches"] == 0
        assert worker.map_peer_cache("prefill-0", export) and worker.stats()["mapped_peer_caches"] == 1
        worker.cancel_incoming(meta.member_id)  # the sender gave up before the copy was queued
        with pytest.raises(KVTransferError, match="withdrawn"):
            worker.receive_kv_shared("prefill-0", meta.to_dict(), "f", table, export)
        stats = worker.stats()
        assert stats["num_free_blocks"] == NUM_BLOCKS and stats["num_running"] == 0
        assert worker.transfer.stats.bytes == 0
        # the sender's retry is not mistaken for the withdrawn one
        assert worker.receive_kv_shared("prefill-0", meta.to_dict(), "f", table, export) > 0
    finally:
        worker.shutdown()
    small = _decode_worker(tiny_model_dir, num_blocks=1)  # the prompt needs 2 blocks
    try:
        assert small.receive_kv_shared("prefill-0", meta.to_dict(), "f", table, export) is None
        assert small.stats()["num_free_blocks"] == 1 and small.transfer.stats.bytes == 0
    finally:
        small.shutdown()
