"""KV resharding between tensor-parallel replicas of different sizes: the routes give every decode
rank exactly its heads from ranks that hold them; each rank's agent moves its part over its own
pair group and checks it; Ray workers with prefill tp=a and decode tp=b decode the same greedy
text as one engine."""

from __future__ import annotations

import threading
import time
import uuid
from pathlib import Path

import pytest
import torch
from baton_serve.workers.errors import KVTransferError
from baton_serve.workers.kv.integrity import block_crcs
from baton_serve.workers.llm import LLM
from baton_serve.workers.parallel.kv_agent import KVAgent
from baton_serve.workers.parallel.kv_routes import reshard_routes
from baton_serve.workers.parallel.sizes import kv_head_owners, kv_heads_of_rank
from baton_serve.workers.sampling.params import SamplingParams
from hypothesis import given
from hypothesis import strategies as st

from tests.tiny_model import write_tiny_llama


def _sizes(heads: int) -> list[int]:
    return [tp for tp in range(1, 2 * heads + 1) if heads % tp == 0 or tp % heads == 0]


@given(st.sampled_from([1, 2, 3, 4, 8]).flatmap(
    lambda h: st.tuples(st.just(h), st.sampled_from(_sizes(h)), st.sampled_from(_sizes(h)))))
def test_every_decode_rank_gets_exactly_its_heads_from_ranks_that_hold_them(case: tuple[int, int, int]) -> None:
    heads, src_tp, dst_tp = case
    routes = reshard_routes(heads, src_tp, dst_tp)
    owners = kv_head_owners(heads, src_tp)
    for dst in range(dst_tp):
        first, count = kv_heads_of_rank(heads, dst_tp, dst)
        got: list[int] = []
        for r in (r for r in routes if r.dst_rank == dst):
            assert r.dst_first == r.head - first  # where they land in the decode rank's cache
            src_first, _ = kv_heads_of_rank(heads, src_tp, r.src_rank)
            for h in range(r.head, r.head + r.count):
                assert r.src_rank in owners[h]
                assert 0 <= h - src_first == r.src_first + (h - r.head)
                got.append(h)
        assert got == list(range(first, first + count))  # each once, in order


def test_replicated_heads_are_sent_by_different_ranks() -> None:
    # 2 KV heads on 4 ranks: each head has two holders, and the two decode ranks wanting a copy
    # of one head take it from different holders
    routes = reshard_routes(2, 4, 4)
    assert sorted(r.src_rank for r in routes) == [0, 1, 2, 3]


def _shards(full: list[tuple[torch.Tensor, torch.Tensor]], heads: int, tp: int) -> list[list[tuple[torch.Tensor, ...]]]:
    out = []
    for rank in range(tp):
        first, count = kv_heads_of_rank(heads, tp, rank)
        out.append([(k[:, :, first:first + count].clone(), v[:, :, first:first + count].clone()) for k, v in full])
    return out


@pytest.mark.parametrize("src_tp,dst_tp", [(1, 2), (2, 1), (2, 2), (4, 2), (1, 4)])
def test_agents_move_each_rank_its_heads_and_check_them(src_tp: int, dst_tp: int) -> None:
    heads, layers, num_blocks, block_size, head_dim = 2, 2, 6, 4, 8
    torch.manual_seed(src_tp * 10 + dst_tp)
    full = [(torch.randn(num_blocks, block_size, heads, head_dim), torch.randn(num_blocks, block_size, heads, head_dim))
            for _ in range(layers)]
    src = [KVAgent(c, block_size, "cpu", "127.0.0.1") for c in _shards(full, heads, src_tp)]
    empty = [[(torch.zeros_like(k), torch.zeros_like(v)) for k, v in shard] for shard in _shards(full, heads, dst_tp)]
    dst = [KVAgent(c, block_size, "cpu", "127.0.0.1") for c in empty]
    routes = reshard_routes(heads, src_tp, dst_tp)
    keys = [f"t-{uuid.uuid4().hex[:6]}-{i}" for i in range(len(routes))]
    send_blocks, recv_blocks, num_tokens = [1, 3, 4], [0, 2, 5], 10  # the last block is half full
    try:
        rdvs = [src[r.src_rank].listen(key, 10.0) for key, r in zip(keys, routes)]
        joins = [threading.Thread(target=src[r.src_rank].join, args=(key, 0)) for key, r in zip(keys, routes)]
        for t in joins:
            t.start()
        for key, r, rdv in zip(keys, routes, rdvs):
            dst[r.dst_rank].join(key, 1, rdv)
        for t in joins:
            t.join(10)

        def ship(corrupt: bool) -> list[BaseException]:
            errors: list[BaseException] = []

            def run(fn, *args, **kwargs) -> None:
                try:
                    fn(*args, **kwargs)
                except BaseException as exc:  # noqa: BLE001
                    errors.append(exc)

            threads = []
            for i, (key, r) in enumerate(zip(keys, routes)):
                crcs = src[r.src_rank].crcs(send_blocks, list(r.src_heads), num_tokens, [0, 1, 2])
                expect = [[d, i, c] for i, (d, c) in enumerate(zip(recv_blocks, crcs))]
                threads.append(threading.Thread(target=run, args=(src[r.src_rank].send, key, send_blocks,
                                                                  list(r.src_heads), 7, False)))
                threads.append(threading.Thread(target=run, args=(dst[r.dst_rank].recv, key, recv_blocks,
                                                                  list(r.dst_heads), 7, expect, num_tokens,
                                                                  corrupt and i == 0)))
            for t in threads:
                t.start()
            for t in threads:
                t.join(20)
            return errors

        assert ship(corrupt=False) == []
        for rank in range(dst_tp):
            first, count = kv_heads_of_rank(heads, dst_tp, rank)
            for (k, v), (fk, fv) in zip(empty[rank], full):
                assert torch.equal(k[recv_blocks], fk[send_blocks][:, :, first:first + count])
                assert torch.equal(v[recv_blocks], fv[send_blocks][:, :, first:first + count])
                assert not k[[1, 3, 4]].any()  # blocks not listed are untouched
        errors = ship(corrupt=True)  # a flipped byte on the first route's receiving rank
        assert len(errors) == 1 and isinstance(errors[0], KVTransferError) and "checksum" in str(errors[0])
    finally:
        for agent in src + dst:
            agent.close()


def test_a_route_crc_covers_only_its_heads() -> None:
    k = torch.randn(2, 4, 2, 8)
    v = torch.randn(2, 4, 2, 8)
    agent = KVAgent([(k, v)], 4, "cpu", "127.0.0.1")
    head0 = agent.crcs([0, 1], [0, 1], 8, [0, 1])
    k[:, :, 1] += 1  # head 1 changes: head 0's checksums do not
    assert agent.crcs([0, 1], [0, 1], 8, [0, 1]) == head0
    assert agent.crcs([0, 1], [0, 2], 8, [0, 1]) == block_crcs([(k, v)], [0, 1], 8, 4)  # all heads: the block's


def test_an_idle_worker_whose_rank_died_reports_itself_unhealthy(tmp_path: Path) -> None:
    # what the controller's health checks read: no request needs to fail on the dead rank first
    import os
    import signal

    from baton_serve.workers.actor.worker import Worker

    model = write_tiny_llama(tmp_path / "m", num_heads=8, num_kv_heads=2, seed=3)
    worker = Worker("colocated-0", "colocated", {"model": str(model), "dtype": "float32", "tensor_parallel_size": 2})
    try:
        assert worker.health() and worker.info()["tensor_parallel_size"] == 2
        (pid,) = worker.core.tensor_parallel.ranks.pids()
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while worker.health() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not worker.health() and worker.stats()["alive"] is False
    finally:
        worker.shutdown()


# ---------------------------------------------------------------------- Ray workers, end to end

ray = pytest.importorskip("ray")
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 9] * 7, list(range(20, 90))]


@pytest.fixture(scope="module")
def model_and_text(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[list[int]]]:
    model = write_tiny_llama(tmp_path_factory.mktemp("reshard"), num_heads=8, num_kv_heads=2, seed=3)
    llm = LLM(model=str(model), dtype="float32", num_threads=1, block_size=8)
    try:
        want = [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS + PROMPTS[:1], GREEDY)]
    finally:
        llm.shutdown()
    return model, want


@pytest.fixture(scope="module")
def ray_session():
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


def _worker(model: Path, wid: str, role: str, tp: int, device: str = "cpu"):
    from baton_serve.workers.actor.worker import Worker

    engine = {"model": str(model), "dtype": "float32", "block_size": 8, "num_kv_blocks": 64,
              "tensor_parallel_size": tp, "device": device}
    # on CUDA the worker's rank processes (mp) use the GPUs Ray gives the worker: rank r on cuda:r
    gpus = tp if device == "cuda" else 0
    return ray.remote(Worker).options(num_cpus=0, num_gpus=gpus, max_concurrency=32).remote(
        wid, role, engine, 1, "auto", 20.0)


def _run(prefill, decode, request_id: str, prompt: list[int]) -> list[int]:
    from baton_serve.workers.actor.messages import decode_deltas, params_to_dict

    ray.get(prefill.add_request.remote(request_id, prompt, params_to_dict(GREEDY), decode_worker="decode-0",
                                       front_id="f"))
    tokens: list[int] = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for worker in (prefill, decode):
            for d in decode_deltas(ray.get(worker.poll.remote("f", 0.1))):
                if d.request_id != request_id:
                    continue
                assert d.finish_reason in (None, "length"), d
                tokens += d.token_ids
                if d.finish_reason == "length" and worker is decode:
                    return tokens
    raise AssertionError(f"{request_id} did not finish: {tokens}")


_NCCL = pytest.mark.skipif(torch.cuda.device_count() < 4, reason="NCCL resharding between two TP=2 replicas "
                           "needs 4 CUDA devices")


@pytest.mark.parametrize("src_tp,dst_tp,device", [(1, 2, "cpu"), (2, 1, "cpu"), (2, 2, "cpu"),
                                                  pytest.param(2, 2, "cuda", marks=_NCCL)])
def test_prefill_tp_a_to_decode_tp_b_decodes_like_one_engine(model_and_text, ray_session, src_tp: int,
                                                             dst_tp: int, device: str) -> None:
    model, want = model_and_text
    prefill = _worker(model, "prefill-0", "prefill", src_tp, device)
    decode = _worker(model, "decode-0", "decode", dst_tp, device)
    try:
        ray.get([prefill.info.remote(), decode.info.remote()], timeout=120)
        ray.get([prefill.set_peers.remote({"decode-0": decode}), decode.set_peers.remote({"prefill-0": prefill})])
        # the third is the first again: its full blocks are in the decode worker's prefix cache
        got, moved = [], []
        for i, prompt in enumerate(PROMPTS + PROMPTS[:1]):
            before = ray.get(decode.stats.remote())["extra"]["kv_transfer"]["bytes"]
            got.append(_run(prefill, decode, f"r{i}", prompt))
            moved.append(ray.get(decode.stats.remote())["extra"]["kv_transfer"]["bytes"] - before)
        assert got == want
        assert 0 < moved[2] < moved[0]  # only the last, partial block travels again
        stats = ray.get(decode.stats.remote())
        assert stats["pair_groups"] == len(reshard_routes(2, src_tp, dst_tp))
        for w in (prefill, decode):  # every shipment's blocks back (cached ones count as free)
            s = ray.get(w.stats.remote())
            assert s["num_free_blocks"] == s["num_blocks"] and s["num_running"] == 0, s
    finally:
        for w in (prefill, decode):
            ray.get(w.shutdown.remote(), timeout=60)
            ray.kill(w)
