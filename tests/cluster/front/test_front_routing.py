"""The front's routing decision without Ray or sockets: real block managers publish KV events, the
front's index follows them, and ``FrontRouter.route`` decides as the live client does."""

from __future__ import annotations

import dataclasses

import pytest
from baton_serve.cluster.front.routing import FrontRouter, output_budget
from baton_serve.cluster.front.workers import CacheLayout, WorkerRef
from baton_serve.router.prefix_index import PrefixIndex
from baton_serve.router.routing import make_policy
from baton_serve.workers.blocks.manager import BlockManager
from baton_serve.workers.blocks.prefix_hash import CacheNamespace
from baton_serve.workers.engine.validation import RequestLimits
from baton_serve.workers.errors import OverloadedError
from baton_serve.workers.kv.event_log import KVEventLog
from baton_serve.workers.sampling.params import SamplingParams

BS = 8
NS = CacheNamespace(model="m", weights_hash="w", block_size=BS)
LIMITS = RequestLimits(vocab_size=1000, max_model_len=512, num_blocks=64, block_size=BS)


def _workers(roles: list[str]) -> list[WorkerRef]:
    info = {"cache_namespace": dataclasses.asdict(NS), "kv_block_bytes": 4096, "block_size": BS}
    counts: dict[str, int] = {}
    out = []
    for role in roles:
        i = counts[role] = counts.get(role, -1) + 1
        out.append(WorkerRef(f"{role}-{i}", role, None, dict(info)))
    return out


def _router(workers: list[WorkerRef], policy: str = "prefix", clock=None, ttl_s: float = 10.0) -> FrontRouter:
    now = clock or (lambda: 0.0)
    return FrontRouter(make_policy(policy), LIMITS, CacheLayout.of(workers), PrefixIndex(ttl_s=ttl_s),
                       colocated=any(w.role == "colocated" for w in workers), clock=now)


def _computed(prompt: list[int]) -> KVEventLog:
    """A worker's event log after it computed ``prompt`` (its full blocks published)."""
    log = KVEventLog()
    bm = BlockManager(64, BS, enable_prefix_caching=True, namespace=NS, event_sink=log)
    assert bm.allocate("r", prompt, 0, len(prompt))
    bm.commit_computed("r", prompt, len(prompt))
    return log


def test_a_prompt_goes_to_the_prefill_worker_whose_events_say_it_holds_its_prefix():
    workers = _workers(["prefill", "prefill", "decode"])
    router = _router(workers)
    prompt = list(range(1, 41))  # 5 full blocks
    for w in workers:
        router.apply_events(w.worker_id, (_computed(prompt) if w.worker_id == "prefill-1" else KVEventLog()).since(None, 0))
    decision, hashes = router.route(workers, prompt + [99], None, SamplingParams(max_tokens=4))
    assert decision.first.worker_id == "prefill-1" and decision.matched_blocks == 5
    assert decision.decode.worker_id == "decode-0" and len(hashes) == 5
    assert decision.estimated_ttft_s is not None and decision.estimated_ttft_s > 0


def test_a_routed_prompt_is_predicted_on_its_workers_before_any_event_says_so():
    workers = _workers(["prefill", "prefill", "decode"])
    router = _router(workers)
    prompt = list(range(100, 164))
    for w in workers:
        router.apply_events(w.worker_id, KVEventLog().since(None, 0))
    first, _ = router.route(workers, prompt, None, SamplingParams(max_tokens=4))
    again, _ = router.route(workers, prompt, None, SamplingParams(max_tokens=4))
    assert again.first is first.first and again.matched_blocks == 7  # 64 tokens: the last is never cached


def test_the_keeper_restricts_the_decode_worker_and_dead_workers_are_never_chosen():
    workers = _workers(["prefill", "decode", "decode"])
    router = _router(workers, policy="round_robin")
    for _ in range(4):
        d, _ = router.route(workers, [1, 2, 3], None, SamplingParams(), keeper="decode-1")
        assert d.decode.worker_id == "decode-1"
    workers[2].alive = False
    for _ in range(4):
        d, _ = router.route(workers, [1, 2, 3], None, SamplingParams())
        assert d.decode.worker_id == "decode-0"
    workers[0].alive = False
    with pytest.raises(OverloadedError, match="a pool has no live worker"):
        router.route(workers, [1, 2, 3], None, SamplingParams())


def test_a_draining_worker_takes_no_new_request_but_its_keepers_reservation_and_its_prefixes_hold():
    workers = _workers(["prefill", "prefill", "decode", "decode"])
    router = _router(workers, policy="prefix")
    prompt = list(range(1, 41))
    for w in workers:
        router.apply_events(w.worker_id, (_computed(prompt) if w.worker_id == "prefill-1" else KVEventLog()).since(None, 0))
    workers[1].draining = workers[3].draining = True
    for _ in range(4):
        d, _ = router.route(workers, prompt + [99], None, SamplingParams(max_tokens=4))
        assert (d.first.worker_id, d.decode.worker_id) == ("prefill-0", "decode-0")
    # stage 2 reserved room on decode-1 before its drain began: the request still goes there
    d, _ = router.route(workers, prompt + [99], None, SamplingParams(max_tokens=4), keeper="decode-1")
    assert d.decode.worker_id == "decode-1"
    assert router.index.match(["prefill-1"], router.prompt_hashes(prompt + [99], None), 0.0)["prefill-1"] == 5
    workers[0].draining = True
    with pytest.raises(OverloadedError, match="a pool has no live worker"):
        router.route(workers, [1, 2, 3], None, SamplingParams())


def test_a_colocated_pool_with_no_live_worker_is_overloaded():
    workers = _workers(["colocated", "colocated"])
    router = _router(workers, policy="least_loaded")
    d, _ = router.route(workers, [1, 2, 3], None, SamplingParams())
    assert d.decode is None and d.first.role == "colocated"
    for w in workers:
        w.alive = False
    with pytest.raises(OverloadedError, match="no colocated worker is alive"):
        router.route(workers, [1, 2, 3], None, SamplingParams())


def test_tenants_salts_hash_apart_and_the_last_token_is_never_hashed():
    router = _router(_workers(["colocated"]))
    prompt = list(range(16))  # two full blocks, but the last position is computed for its logits
    assert len(router.prompt_hashes(prompt, None)) == 1
    assert router.prompt_hashes(prompt + [1], "acme") != router.prompt_hashes(prompt + [1], None)
    assert router.prompt_hashes(prompt + [1], "acme") == router.prompt_hashes(prompt + [1], "acme")


def test_a_worker_silent_for_the_index_ttl_matches_nothing():
    now = [0.0]
    workers = _workers(["prefill", "prefill", "decode"])
    router = _router(workers, clock=lambda: now[0], ttl_s=5.0)
    prompt = list(range(1, 41))
    router.apply_events("prefill-0", _computed(prompt).since(None, 0))
    router.apply_events("prefill-1", KVEventLog().since(None, 0))
    d, _ = router.route(workers, prompt + [1], None, SamplingParams(max_tokens=2))
    assert d.first.worker_id == "prefill-0" and d.matched_blocks == 5
    now[0] = 30.0  # its predictions and its events are both older than the ttl
    router.expire(workers)
    assert router.index.is_stale("prefill-0")
    d, _ = router.route(workers, prompt + [1], None, SamplingParams(max_tokens=2))
    assert d.matched_blocks == 0


def test_output_budget_is_max_tokens_capped_by_the_context_left():
    assert output_budget(LIMITS, 500, SamplingParams(max_tokens=100)) == 12
    assert output_budget(LIMITS, 10, SamplingParams(max_tokens=100)) == 100
    assert output_budget(LIMITS, 10, SamplingParams(max_tokens=None)) == 502
