"""Every routing policy against fake workers with known caches and queues (no Ray)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import pytest
from baton_serve.router.prefix_index import PrefixIndex
from baton_serve.router.routing import Candidates, RouteRequest, WorkerLoad, make_policy, policy_names
from baton_serve.router.routing.cost_model import CostModel
from baton_serve.router.routing.rates import LinearCost

BS = 16
BLOCK_BYTES = 2 * 30 * BS * 3 * 64 * 4  # SmolLM2-135M's KV per block in fp32


@dataclass
class Fake:
    worker_id: str
    role: str = "prefill"
    load: WorkerLoad = field(default_factory=WorkerLoad)


def _fit(fixed: float, per_unit: float) -> LinearCost:
    return LinearCost(fixed=fixed, per_unit=per_unit, fitted=True)


def _worker(wid: str, role: str = "prefill", pending: int = 0, outstanding: int = 0, running: int = 0,
            free_blocks: int = 1000, prefill=(0.005, 1 / 2000), decode=(0.02, 0.002),
            ship=(0.005, 1 / 1e9)) -> Fake:
    # sole_front=False: the reported counts below are what the policy goes by
    load = WorkerLoad(outstanding=outstanding, num_running=running, num_free_blocks=free_blocks,
                      sole_front=False,
                      num_blocks=1000, reported_pending_prefill=pending, prefill=_fit(*prefill),
                      decode=_fit(*decode), ship=_fit(*ship))
    return Fake(wid, role, load)


def _request(prompt_len: int = 1024, max_tokens: int = 16) -> RouteRequest:
    hashes = [bytes([i]) * 16 for i in range((prompt_len - 1) // BS)]
    return RouteRequest(prompt_len, hashes, BS, max_tokens, BLOCK_BYTES)


def test_the_registry_names_every_policy_and_refuses_unknown_ones() -> None:
    assert policy_names() == ["cost", "least_loaded", "prefix", "round_robin"]
    with pytest.raises(ValueError, match="known: cost, least_loaded, prefix, round_robin"):
        make_policy("fastest")


def test_a_sole_front_trusts_its_own_counts_over_a_stale_report() -> None:
    load = WorkerLoad(outstanding=1, local_pending_prefill=40, num_running=5, reported_pending_prefill=900)
    assert load.pending_prefill == 40 and load.running == 1  # the report still counts finished work
    load.sole_front = False  # other fronts' work shows only in the report
    assert load.pending_prefill == 900 and load.running == 5


# ---------------------------------------------------------------------- round_robin, least_loaded
def test_round_robin_cycles_each_pool_in_id_order() -> None:
    rr = make_policy("round_robin")
    p = [_worker("p1"), _worker("p0")]
    d = [_worker("d0", "decode"), _worker("d1", "decode"), _worker("d2", "decode")]
    picks = [rr.route(_request(), Candidates(p, d)) for _ in range(6)]
    assert [x.first.worker_id for x in picks] == ["p0", "p1"] * 3
    assert [x.decode.worker_id for x in picks] == ["d0", "d1", "d2"] * 2
    assert {x.reason for x in picks} == {"round_robin"}


def test_least_loaded_takes_the_fewest_in_flight_and_breaks_ties_at_random() -> None:
    ll = make_policy("least_loaded", seed=1)
    p = [_worker("p0", outstanding=3), _worker("p1", outstanding=1), _worker("p2", outstanding=1)]
    d = [_worker("d0", "decode"), _worker("d1", "decode")]
    d[0].load.kv_cache_usage = 0.5
    picks = Counter()
    for _ in range(200):
        x = ll.route(_request(), Candidates(p, d))
        picks[x.first.worker_id] += 1
        assert x.decode.worker_id == "d1"
    assert set(picks) == {"p1", "p2"} and min(picks.values()) > 50


# ---------------------------------------------------------------------- prefix
def test_prefix_follows_the_longest_match_while_the_pool_is_balanced() -> None:
    pol = make_policy("prefix", seed=0)
    p = [_worker("p0", outstanding=10), _worker("p1", outstanding=0)]
    x = pol.route(_request(), Candidates(p, [], {"p0": 60, "p1": 2}))
    assert x.first.worker_id == "p0" and x.reason == "prefix" and x.matched_blocks == 60


def test_prefix_goes_to_the_least_loaded_when_the_pool_is_out_of_balance_or_nothing_matches() -> None:
    pol = make_policy("prefix", seed=0)
    p = [_worker("p0", outstanding=40), _worker("p1", outstanding=2)]
    x = pol.route(_request(), Candidates(p, [], {"p0": 60}))
    assert x.first.worker_id == "p1" and x.reason == "imbalance"
    p[0].load.outstanding = 5
    cold = pol.route(_request(), Candidates(p, [], {"p0": 10}))  # 160 of 1024 tokens: under the threshold
    assert cold.first.worker_id == "p1" and cold.reason == "cold"
    empty = pol.route(_request(), Candidates(p, [], {}))
    assert empty.first.worker_id == "p1" and empty.reason == "cold"


def test_prefix_places_a_new_prefix_in_the_cache_that_holds_least() -> None:
    """SGLang's "smallest tree": below the match threshold, the worker caching least, whatever
    its queue; the least loaded among equals; and so in the decode pool."""
    pol = make_policy("prefix", seed=0)
    p = [_worker("p0", outstanding=0), _worker("p1", outstanding=3), _worker("p2", outstanding=1)]
    d = [_worker("d0", "decode"), _worker("d1", "decode")]
    cached = {"p0": 300, "p1": 120, "p2": 120, "d0": 50, "d1": 10}
    x = pol.route(_request(), Candidates(p, d, {"p0": 10}, cached_blocks=cached))
    assert (x.first.worker_id, x.decode.worker_id, x.reason) == ("p2", "d1", "cold")


# ---------------------------------------------------------------------- cost
def test_cost_sends_a_prompt_to_the_worker_holding_its_prefix_when_queues_are_equal() -> None:
    pol = make_policy("cost", seed=0)
    p = [_worker("p0"), _worker("p1")]
    d = [_worker("d0", "decode"), _worker("d1", "decode")]
    x = pol.route(_request(), Candidates(p, d, {"p1": 63}))
    assert x.first.worker_id == "p1" and x.reason == "prefix" and x.decode is not None
    assert x.estimated_ttft_s == pytest.approx(0.005 + 1 / 2000 * (1024 - 63 * BS))


def test_cost_avoids_a_hotspot_whose_queue_costs_more_than_its_cache_saves() -> None:
    pol = make_policy("cost", seed=0)
    hot = _worker("p0", pending=8000)  # 4 s of queued prefill
    p = [hot, _worker("p1")]
    d = [_worker("d0", "decode")]
    x = pol.route(_request(), Candidates(p, d, {"p0": 63}))
    assert x.first.worker_id == "p1" and x.reason == "hotspot_avoided"
    hot.load.reported_pending_prefill = 200  # a short queue: the cache wins again
    assert pol.route(_request(), Candidates(p, d, {"p0": 63})).first.worker_id == "p0"


def test_cost_with_an_empty_index_follows_the_queues() -> None:
    pol = make_policy("cost", seed=0)
    p = [_worker("p0", pending=3000), _worker("p1", pending=100)]
    x = pol.route(_request(), Candidates(p, [_worker("d0", "decode")], {}))
    assert x.first.worker_id == "p1" and x.reason == "load" and x.matched_blocks == 0


def test_cost_breaks_ties_at_random() -> None:
    pol = make_policy("cost", seed=3)
    p = [_worker("p0"), _worker("p1")]
    d = [_worker("d0", "decode"), _worker("d1", "decode")]
    firsts, decodes = Counter(), Counter()
    for _ in range(200):
        x = pol.route(_request(), Candidates(p, d, {}))
        firsts[x.first.worker_id] += 1
        decodes[x.decode.worker_id] += 1
    assert min(firsts.values()) > 50 and min(decodes.values()) > 50


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("layout", ["2P+1D", "colocated"])
def test_cost_puts_a_new_prefix_where_it_evicts_least(seed: int, layout: str) -> None:
    """Idle workers holding nothing of the prompt: the one whose cache is full of other prefixes
    would evict 65 cached blocks for it, the other has empty room. Not a coin toss any more."""
    pol = make_policy("cost", seed=seed)
    role = "colocated" if layout == "colocated" else "prefill"
    full, roomy = _worker("w0", role, free_blocks=900), _worker("w1", role, free_blocks=900)
    d = [] if layout == "colocated" else [_worker("d0", "decode")]
    cached = {"w0": 900, "w1": 300}  # w0's free blocks all hold cached prefixes; w1 has 600 empty
    x = pol.route(_request(), Candidates([full, roomy], d, {}, cached_blocks=cached))
    assert x.first.worker_id == "w1" and x.reason == "load"
    # room on both, as much on each: a tie again, broken at random
    firsts = Counter(pol.route(_request(), Candidates([full, roomy], d, {}, cached_blocks={"w0": 100, "w1": 100})
                               ).first.worker_id for _ in range(100))
    assert min(firsts.values()) > 20


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("layout", ["2P+1D", "colocated"])
def test_a_new_prefix_goes_to_the_roomier_cache_when_the_estimates_differ_by_fit_noise(seed: int, layout: str) -> None:
    """Idle workers, neither holding the prompt (63 full blocks), both with room for it: the one
    measured 15% faster has room for fewer more prompts like it. The prefix goes where the cache
    has room for more, unless the estimates differ by more than ``placement_tolerance``; where
    both have room for as many whole prompts, or some worker holds part of the prompt, room does
    not decide."""
    role = "colocated" if layout == "colocated" else "prefill"
    d = [] if layout == "colocated" else [_worker("d0", "decode")]
    fuller, roomy = _worker("w0", role, free_blocks=900), _worker("w1", role, free_blocks=900, prefill=(0.005, 1.15 / 2000))
    cached = {"w0": 800, "w1": 200}  # 100 empty blocks on w0, 700 on w1
    pol = make_policy("cost", seed=seed)
    x = pol.route(_request(), Candidates([fuller, roomy], d, {}, cached_blocks=cached))
    assert x.first.worker_id == "w1" and x.reason == "cache_room"
    for off in (make_policy("cost", seed=seed, placement_tolerance=0.0), make_policy("cost", seed=seed, placement_tolerance=0.1)):
        assert off.route(_request(), Candidates([fuller, roomy], d, {}, cached_blocks=cached)).first.worker_id == "w0"
    spare = pol.route(_request(), Candidates([fuller, roomy], d, {}, cached_blocks={"w0": 600, "w1": 200}))
    assert spare.first.worker_id == "w1" and spare.reason == "cache_room"  # 300 empty: 4 prompts, 700: 11
    alike = pol.route(_request(), Candidates([fuller, roomy], d, {}, cached_blocks={"w0": 600, "w1": 590}))
    assert alike.first.worker_id == "w0" and alike.reason == "load"  # 300 and 310 empty: 4 prompts each
    held = pol.route(_request(), Candidates([fuller, roomy], d, {"w0": 8}, cached_blocks=cached))
    assert held.first.worker_id == "w0" and held.reason == "prefix"
    if d:  # a decode worker holding part of it: not a new prefix either
        at_decode = pol.route(_request(), Candidates([fuller, roomy], d, {"d0": 8}, cached_blocks=cached))
        assert at_decode.reason != "cache_room"


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("layout", ["2P+2D", "colocated"])
def test_new_prefixes_spread_over_every_worker_of_a_pool_of_equals(seed: int, layout: str) -> None:
    """A deployment's first prompts, one at a time on idle identical workers (a benchmark's warm-up):
    eight system prompts of 63 blocks, each left cached where it ran. Their estimates are all
    equal, and a coin toss put four on one worker and none on another; each cache now takes two,
    and so does each decode worker."""
    role = "colocated" if layout == "colocated" else "prefill"
    first = [_worker(f"w{i}", role, free_blocks=364) for i in range(4 if layout == "colocated" else 2)]
    d = [] if layout == "colocated" else [_worker(f"d{i}", "decode", free_blocks=364) for i in range(2)]
    pol = make_policy("cost", seed=seed)
    cached: Counter[str] = Counter()
    for _ in range(8):
        x = pol.route(_request(), Candidates(first, d, {}, cached_blocks=dict(cached)))
        assert x.reason in ("load", "cache_room")
        for w in (x.first, x.decode):
            if w is not None:
                cached[w.worker_id] += 63
    assert all(cached[w.worker_id] == (2 if layout == "colocated" else 4) * 63 for w in first)
    assert all(cached[w.worker_id] == 4 * 63 for w in d)


def test_the_eviction_price_never_outweighs_a_holder_of_the_prefix() -> None:
    """A full cache that holds the prompt's prefix needs a block or two for the tail: it keeps the
    request rather than a cold copy being made on a roomy worker."""
    pol = make_policy("cost", seed=0)
    p = [_worker("p0", free_blocks=900), _worker("p1", free_blocks=900)]
    x = pol.route(_request(), Candidates(p, [_worker("d0", "decode")], {"p0": 63}, cached_blocks={"p0": 900}))
    assert x.first.worker_id == "p0" and x.reason == "prefix"


def test_the_eviction_price_counts_only_blocks_beyond_the_empty_room() -> None:

    m, w = CostModel(), _worker("w0", free_blocks=100)  # prefill fit: 1/2000 s per token
    req = _request(1024, max_tokens=0)  # 64 blocks
    assert m.evict_s(w, req, 0, 36, [w]) == 0.0  # 64 empty blocks: room enough
    assert m.evict_s(w, req, 0, 46, [w]) == pytest.approx(10 * BS / 2000)  # 54 empty: 10 evicted
    assert m.evict_s(w, req, 0, 500, [w]) == pytest.approx(64 * BS / 2000)  # every free block is cached
    assert m.evict_s(w, req, 60, 500, [w]) == pytest.approx(4 * BS / 2000)  # the prefix is there already
    assert CostModel(evict_weight=0).evict_s(w, req, 0, 500, [w]) == 0.0


def test_cost_prefers_the_decode_worker_that_holds_the_prefix_when_shipping_is_slow() -> None:
    pol = make_policy("cost", seed=0, conditional_disaggregation=False)
    slow_link = (0.005, 1 / 50e6)  # 50 MB/s: a 1k-token prompt's KV takes ~0.9 s
    p = [_worker("p0", ship=slow_link)]
    d = [_worker("d0", "decode"), _worker("d1", "decode")]
    x = pol.route(_request(), Candidates(p, d, {"d1": 60}))
    assert x.decode.worker_id == "d1"


def test_cost_keeps_off_a_decode_worker_without_room() -> None:
    pol = make_policy("cost", seed=0, conditional_disaggregation=False)
    d = [_worker("d0", "decode", free_blocks=2), _worker("d1", "decode", running=20)]  # d0 lacks 3 blocks
    x = pol.route(_request(), Candidates([_worker("p0")], d, {"d0": 60}))
    assert x.decode.worker_id == "d1"


def test_a_decode_worker_that_lacks_the_prefix_pays_for_the_cached_prefixes_it_would_evict() -> None:
    pol = make_policy("cost", seed=0, conditional_disaggregation=False)
    p = [_worker("p0")]
    # d0 holds the prompt's prefix and decodes 8 sequences; d1 decodes none, but its cache is full
    # of other prefixes: the prompt's 65 blocks would push 65 of theirs out
    d = [_worker("d0", "decode", running=8, free_blocks=100), _worker("d1", "decode", free_blocks=100)]
    held = Candidates(p, d, {"p0": 63, "d0": 63}, cached_blocks={"p0": 63, "d0": 100, "d1": 100})
    assert pol.route(_request(), held).decode.worker_id == "d0"
    # with room to spare on d1, its smaller batch wins
    roomy = Candidates(p, d, {"p0": 63, "d0": 63}, cached_blocks={"p0": 63, "d0": 100, "d1": 0})
    assert pol.route(_request(), roomy).decode.worker_id == "d1"


@pytest.mark.parametrize("seed", range(5))
def test_where_every_decode_worker_is_full_ties_are_judged_without_the_room_penalty(seed: int) -> None:
    # the penalty is in every price: 1% of it (0.6 s) must not tie the holder of the prefix with a
    # worker that would compute the whole prompt
    pol = make_policy("cost", seed=seed)
    fast = (0.005, 1 / 10000)  # the whole prompt costs ~0.2 s more than its tail, twice
    p = [_worker("p0", prefill=fast), _worker("p1", prefill=fast)]
    d = [_worker("d0", "decode", free_blocks=2, running=30, prefill=fast)]
    picks = {pol.route(_request(), Candidates(p, d, {"p0": 63})).first.worker_id for _ in range(20)}
    assert picks == {"p0"}


def test_conditional_disaggregation_prefills_a_short_uncached_tail_on_the_decode_worker() -> None:
    pol = make_policy("cost", seed=0)
    across_nodes = (0.03, 1 / 0.4e9)  # the veth link between two nodes, measured: 30 ms a shipment
    p = [_worker("p0", pending=500, ship=across_nodes)]
    d = [_worker("d0", "decode", running=1)]
    # a 1k-token system prompt the decode worker holds, plus a short user turn: no shipment
    x = pol.route(_request(1024 + 40), Candidates(p, d, {"p0": 64, "d0": 64}))
    assert x.first.worker_id == "d0" and x.decode is None and x.local and x.reason == "local_prefill"
    # a long uncached prompt: the prefill pool does it, and the KV travels
    y = pol.route(_request(2048), Candidates(p, d, {"p0": 64, "d0": 0}))
    assert y.first.worker_id == "p0" and y.decode.worker_id == "d0" and not y.local
    # a decode worker busy with many streams: the stall it would inflict outweighs the shipment
    d[0].load.num_running = 60
    z = pol.route(_request(1024 + 40), Candidates(p, d, {"p0": 64, "d0": 64}))
    assert z.first.worker_id == "p0" and z.decode.worker_id == "d0"
    off = make_policy("cost", seed=0, conditional_disaggregation=False)
    d[0].load.num_running = 1
    assert off.route(_request(1024 + 40), Candidates(p, d, {"p0": 64, "d0": 64})).decode is not None
    # a fast link and no queue at the prefill worker: shipping the tail adds less than computing
    # it here, so the pools stay disaggregated
    p[0].load.ship = _fit(0.001, 1 / 10e9)
    p[0].load.reported_pending_prefill = 0
    assert pol.route(_request(1024 + 40), Candidates(p, d, {"p0": 64, "d0": 64})).decode is not None


def test_a_short_tail_escapes_a_prefill_queue_to_the_decode_worker_that_holds_its_prefix() -> None:
    """A fast link (shipping beats computing the tail locally), so only the prefill pool's queue
    can make a local prefill worth it: behind a 1k-token prefill the tail is computed on the
    decode worker holding the prefix; with the queue gone it is shipped again."""
    pol = make_policy("cost", seed=0)
    loopback = (0.002, 1 / 5e9)
    p = [_worker("p0", pending=1056, ship=loopback)]
    d = [_worker("d0", "decode", running=3)]
    request, matched = _request(1024 + 40), {"p0": 64, "d0": 64}
    assert CostModel().prefill_s(d[0], 40, d) > CostModel().ship_s(p[0], request, 64, p)  # the old gate said no
    x = pol.route(request, Candidates(p, d, matched))
    assert x.local and x.first.worker_id == "d0" and x.reason == "local_prefill"
    p[0].load.reported_pending_prefill = 0
    y = pol.route(request, Candidates(p, d, matched))
    assert not y.local and y.first.worker_id == "p0" and y.decode.worker_id == "d0"


def test_a_prefix_only_a_decode_worker_holds_is_prefilled_there_not_again_in_the_prefill_pool() -> None:
    """The 0.6-load 2P+2D log (seed 2, request 240): the decode worker held the whole 1k prefix, the
    prefill workers 30 blocks of it behind a queue and none of it; the old gate (the tail's compute
    here against the best shipment + queue alone) left the idle prefill worker's short queue as
    the bar, so 576 tokens were computed again in the pool and four requests behind them waited."""
    pol = make_policy("cost", seed=0)
    pf, loopback = (0.053, 0.0017), (0.06, 2e-9)
    p = [_worker("p0", pending=128, prefill=pf, ship=loopback), _worker("p1", pending=32, prefill=pf, ship=loopback)]
    d = [_worker("d0", "decode", running=7, decode=(0.035, 0.0008)),
         _worker("d1", "decode", running=2, decode=(0.04, 0.0032))]
    for w in d:  # a decode worker that never prefilled borrows the pool's prefill fit
        w.load.prefill = LinearCost()
    request, matched = _request(1024 + 32), {"p0": 30, "d1": 64}
    m = CostModel()
    tail = request.uncached(64)
    old_bar = min(m.ship_s(w, request, 64, p + d) + m.queue_s(w, p + d) for w in p)
    assert m.prefill_s(d[1], tail, p + d) + m.decoding_s(d[1], tail, p + d) > old_bar  # the old gate said no
    x = pol.route(request, Candidates(p, d, matched))
    assert x.local and x.first.worker_id == "d1" and x.reason == "local_prefill"
    # the prefill pool holding the prefix as well, and idle: the tail is computed there
    p[1].load.reported_pending_prefill = 0
    y = pol.route(request, Candidates(p, d, {"p0": 30, "p1": 64, "d1": 64}))
    assert not y.local and y.first.worker_id == "p1"


def test_an_idle_decode_worker_leaves_a_prompt_nobody_holds_to_the_prefill_pool() -> None:
    pol = make_policy("cost", seed=0)
    x = pol.route(_request(), Candidates([_worker("p0")], [_worker("d0", "decode")]))
    assert not x.local and x.first.worker_id == "p0" and x.decode.worker_id == "d0"


def test_cost_on_colocated_workers_weighs_cache_against_queue() -> None:
    pol = make_policy("cost", seed=0)
    c = [_worker("c0", "colocated", pending=100), _worker("c1", "colocated")]
    assert pol.route(_request(), Candidates(c, [], {"c0": 63})).first.worker_id == "c0"
    c[0].load.reported_pending_prefill = 10000
    x = pol.route(_request(), Candidates(c, [], {"c0": 63}))
    assert x.first.worker_id == "c1" and x.decode is None


def test_unmeasured_workers_borrow_the_pools_fit() -> None:
    pol = make_policy("cost", seed=0)
    fresh = Fake("p1", "prefill", WorkerLoad(reported_pending_prefill=1000, sole_front=False))  # nothing fitted yet
    measured = _worker("p0", pending=1000, prefill=(0.0, 1 / 100))  # a slow pool: 100 tokens/s
    decode = _worker("d0", "decode", prefill=(0.0, 1 / 100))  # as slow: no escape to a local prefill
    x = pol.route(_request(), Candidates([measured, fresh], [decode], {"p0": 63}))
    # with the pool's 100 tokens/s, fresh's 1000 queued tokens cost 10 s: the holder wins
    assert x.first.worker_id == "p0"


@pytest.mark.parametrize("name", ["round_robin", "least_loaded", "prefix", "cost"])
def test_a_stale_or_removed_worker_never_breaks_a_decision(name: str) -> None:
    index = PrefixIndex(ttl_s=5.0)

    class B:
        epoch, seq, events, resync, reason = "e", 1, [], True, "epoch"
        hashes = _request().block_hashes

    index.apply("p0", B(), now=0.0)
    index.apply("gone", B(), now=0.0)
    index.expire(now=10.0)  # p0 went silent: stale
    pol = make_policy(name)
    p = [_worker("p0"), _worker("p1")]
    matched = index.match(["p0", "p1", "gone"], _request().block_hashes, now=10.0)
    assert matched["p0"] == 0
    # "gone" left the pool between the lookup and the decision: it is in the matches, not the pool
    x = pol.route(_request(), Candidates(p, [_worker("d0", "decode")], matched, {"p0"}))
    assert x.first.worker_id in {"p0", "p1"} and x.first.worker_id != "gone"


def test_a_holder_one_prefill_deep_keeps_its_prefix_rather_than_a_cold_copy_being_made() -> None:
    # The holder's queue (1100 tokens) takes about as long as the whole prompt would take an idle
    # worker: by TTFT alone the idle one wins, but its cold copy of the prefix costs the requests
    # that arrive after it. A queue twice as deep is a hotspot: then the request moves.
    p = [_worker("p0", pending=1100), _worker("p1")]
    d = [_worker("d0", "decode")]
    myopic = make_policy("cost", seed=0, work_weight=0.0)
    assert myopic.route(_request(), Candidates(p, d, {"p0": 63})).first.worker_id == "p1"
    pol = make_policy("cost", seed=0)
    assert pol.route(_request(), Candidates(p, d, {"p0": 63})).first.worker_id == "p0"
    p[0].load.reported_pending_prefill = 3000
    assert pol.route(_request(), Candidates(p, d, {"p0": 63})).first.worker_id == "p1"


def _queued(worker: Fake, requests: int, budget: int = 1024) -> Fake:
    worker.load.num_waiting, worker.load.step_token_budget = requests, budget
    return worker


def test_a_prompt_joins_the_step_of_the_queue_s_last_tokens() -> None:
    joined = CostModel.joined
    # five 32-token tails wait: a 544-token prompt shares their step, all its tokens
    assert joined(_queued(_worker("p", pending=160), 5), 544) == (5.0, 544)
    # only what is left of the step's budget joins it
    assert joined(_queued(_worker("p", pending=160), 5), 2000) == (5.0, 864)
    # a queue of whole steps and more: the step it shares holds the last 160 tokens' share of requests
    queued, added = joined(_queued(_worker("p", pending=1024 + 160), 6), 544)
    assert queued == pytest.approx(6 * 160 / 1184) and added == 544
    # a queue of exactly whole steps: it starts one of its own
    assert joined(_queued(_worker("p", pending=2048), 4), 544) == (0.0, 0)
    # nothing queued, or no budget reported (then one step takes all)
    assert joined(_worker("p"), 544) == (0.0, 0)
    assert joined(_queued(_worker("p", pending=160), 5, budget=0), 544) == (5.0, 544)
    # the sole front's own count of requests waiting for their first token
    load = WorkerLoad(local_pending_prefill=64, local_pending_requests=2, num_waiting=9, step_token_budget=1024)
    assert joined(Fake("p", load=load), 100) == (2.0, 100)


def test_a_long_prompt_goes_where_it_holds_up_fewest_queued_tails() -> None:
    # Seen on 2P+2D at 6.48 req/s (decision 242 of seed 2): p1 held half of a cold prompt's prefix
    # and had five hot 32-token tails waiting; the prompt's 544 tokens joined their step, and all
    # six got their first token 1.5-1.7 s later (0.17-0.38 s estimated for the tails). p0 holds
    # nothing of it and has one tail waiting.
    def pools() -> tuple[list[Fake], list[Fake]]:
        p = [_queued(_worker("p0", pending=32, prefill=(0.02, 0.0014)), 1),
             _queued(_worker("p1", pending=160, prefill=(0.02, 0.0014)), 5)]
        return p, [_worker("d0", "decode"), _worker("d1", "decode")]

    request, held = _request(1056), {"p1": 32}
    pol = make_policy("cost", seed=0)
    assert pol.route(request, Candidates(*pools(), held)).first.worker_id == "p0"
    p, d = pools()
    for w in p:
        w.load.num_waiting = 0  # the queue's requests unseen: their tokens alone do not decide it
    assert pol.route(request, Candidates(p, d, held)).first.worker_id == "p1"
    # a short tail of a held prefix still joins the holder's queue
    assert pol.route(request, Candidates(*pools(), {"p1": 64})).first.worker_id == "p1"


# ---------------------------------------------------------------------- cost, on cores shared on a board
def _on_board(workers: list[Fake], cores: int = 2, board: str = "node:/dev/shm/baton-cores-x") -> list[Fake]:
    for w in workers:
        w.load.core_board, w.load.board_cores, w.load.step_threads = board, cores, 1
    return workers


def _two_by_two(d0_running: int = 4) -> tuple[list[Fake], list[Fake]]:
    # p0 prefills a queue of 400 tokens (0.2 s), d0 decodes, p1 and d1 are idle
    p = [_worker("p0", pending=400, outstanding=1), _worker("p1")]
    d = [_worker("d0", "decode", running=d0_running), _worker("d1", "decode")]
    return p, d


def test_a_prefill_stalls_the_sequences_running_there_by_its_tokens_not_by_a_step_overhead() -> None:
    m = CostModel()
    # a step overhead of 0.2 s (mixed steps charge part of the decode batch's time to prefill)
    w = _worker("c0", "colocated", running=18, prefill=(0.2, 1 / 2000))
    assert m.stall_s(w, _request(), 60, [w]) == pytest.approx(18 * (1024 - 60 * BS) / 2000)
    assert m.stall_s(w, _request(), 0, [w]) == pytest.approx(18 * 1024 / 2000)
    assert CostModel(stall_weight=0).stall_s(w, _request(), 0, [w]) == 0.0
    w.load.num_running = 0
    assert m.stall_s(w, _request(), 0, [w]) == 0.0


def test_a_stats_snapshot_names_the_board_a_worker_takes_turns_at() -> None:
    load = WorkerLoad()
    load.update({"extra": {"core_share": {"board": "n1:/dev/shm/b", "cores": 2, "threads": 1}}})
    assert (load.core_board, load.board_cores, load.step_threads) == ("n1:/dev/shm/b", 2, 1)
    load.update({"extra": {"core_share": None}})  # cores of its own (a restarted worker may differ)
    assert load.core_board == "" and load.board_cores == 0


def test_the_share_factor_counts_the_threads_stepping_on_the_board_over_its_cores() -> None:
    m = CostModel()
    p, d = _two_by_two()
    pool = _on_board(p + d)
    # d1 decoding beside d0 (decoding all along) and p0 (busy 0.2 s of the 0.4): 2.5 threads, 2 cores
    assert m.share_factor(d[1], 0.4, pool) == pytest.approx((1 + 1 + 0.5) / 2)
    assert m.share_factor(d[1], 0.1, pool) == pytest.approx(1.5)  # p0 busy all of a short horizon
    assert m.share_factor(d[0], 0.4, pool) == pytest.approx(1.0)  # d0 and half of p0: room for both
    assert CostModel(share_weight=0).share_factor(d[1], 0.4, pool) == 1.0
    assert m.share_factor(d[1], 0.4, _on_board(p + d, cores=4)) == 1.0
    p, d = _two_by_two()
    assert m.share_factor(d[1], 0.4, p + d) == 1.0  # cores of their own
    assert m.share_factor(d[1], 0.4, p + d[:1] + _on_board([d[1]])) == 1.0  # nobody else on its board


def test_a_request_s_core_time_is_its_tokens_and_its_share_of_the_steps_it_joins() -> None:
    m = CostModel()
    busy, idle = _worker("c0", "colocated", running=4), _worker("c1", "colocated")
    # the prompt rides in steps that happen anyway; each decode step's 20 ms is shared by 5 sequences
    assert m.stepping_s(busy, 1024, 16, [busy, idle]) == pytest.approx(1024 / 2000 + 16 * (0.002 + 0.02 / 5))
    assert m.stepping_s(idle, 1024, 16, [busy, idle]) == pytest.approx(0.005 + 1024 / 2000 + 16 * (0.02 + 0.002))
    big = _worker("c2", "colocated", running=39)  # a large batch: its steps cost the newcomer little
    assert m.stepping_s(big, 0, 16, [big]) == pytest.approx(16 * (0.002 + 0.02 / 40))
    parked = _worker("p0", outstanding=3)  # a prefill worker's requests wait for their shipment
    assert m.stepping_s(parked, 100, 0, [parked]) == pytest.approx(0.005 + 100 / 2000)


def test_on_a_full_board_added_core_time_is_taken_from_the_mates_requests() -> None:
    m = CostModel()
    p, d = _two_by_two()
    d[1].load.num_running = 2
    assert m.board_s(p[0], 1.0, p + d) == 0.0  # cores of their own
    pool = _on_board(p + d)
    # p0, d0 and d1 step: 3 threads on 2 cores, so p0's added second comes out of d0's and d1's
    # turns, each of their 6 sequences waiting for half of it
    assert m.board_s(p[0], 1.0, pool) == pytest.approx(1.0 * 6 / 2)
    # idle p1 woken: the second comes from p0's request and the 6 sequences' three threads
    assert m.board_s(p[1], 1.0, pool) == pytest.approx(1.0 * 7 / 3)
    assert CostModel(share_weight=0).board_s(p[0], 1.0, pool) == 0.0
    d[1].load.num_running = 0  # d0 alone beside p0: both fit, nothing is taken
    assert m.board_s(p[0], 1.0, pool) == 0.0
    d[1].load.demand = 0.5  # idle now, but it wanted the cores half of the time lately
    assert m.board_s(p[0], 1.0, pool) == pytest.approx(0.5 * (4 + 0.5) / 1.5)


def test_a_worker_s_demand_for_cores_follows_its_stepping_and_waiting_over_time() -> None:
    load = WorkerLoad()
    load.update({"busy_seconds": 0.0}, now=10.0)
    assert load.demand == 0.0
    load.update({"busy_seconds": 0.5, "extra": {"core_wait_seconds": 0.3}}, now=11.0)
    assert load.demand == pytest.approx(0.5 * 0.8)
    load.update({"busy_seconds": 1.5, "extra": {"core_wait_seconds": 0.3}}, now=12.0)
    assert load.demand == pytest.approx(0.5 * 0.4 + 0.5 * 1.0)
    load.update({"busy_seconds": 0.1}, now=13.0)  # restarted: a new baseline, nothing learnt
    assert load.demand == pytest.approx(0.7)
    load.update({"busy_seconds": 0.1}, now=14.0)
    assert load.demand == pytest.approx(0.35)


@pytest.mark.parametrize("seed", range(3))
def test_on_a_board_busy_lately_an_idle_holder_beats_a_busy_worker_that_would_copy_the_prefix(seed: int) -> None:
    pol = make_policy("cost", seed=seed)
    c = _on_board([_worker("c0", "colocated", pending=1100, running=3), _worker("c1", "colocated"),
                   _worker("c2", "colocated", running=20), _worker("c3", "colocated")])
    c[1].load.demand = c[3].load.demand = 0.3
    # waking c1 takes its request's few steps from the mates; c0's copy of the prefix would take
    # 1k tokens of compute from them, beside c0's own queue and the stall of its sequences
    assert pol.route(_request(), Candidates(c, [], {"c1": 63})).first.worker_id == "c1"


@pytest.mark.parametrize("seed", range(3))
def test_on_a_full_board_a_busy_holder_keeps_its_prefix_longer_than_on_cores_of_its_own(seed: int) -> None:
    def workers(pending: int) -> list[Fake]:
        return [_worker("c0", "colocated", pending=pending, running=4), _worker("c1", "colocated", running=1),
                _worker("c2", "colocated", running=1)]

    pol, blind = make_policy("cost", seed=seed), make_policy("cost", seed=seed, share_weight=0)
    # c0's queue (3000 tokens, 1.5 s) is a hotspot on its own cores: a busy worker copies the prefix
    assert pol.route(_request(), Candidates(workers(3000), [], {"c0": 63})).first.worker_id != "c0"
    # on one board the cold copy's 1k tokens hold up the mates' sequences: the holder keeps it
    shared = _on_board(workers(3000))
    assert pol.route(_request(), Candidates(shared, [], {"c0": 63})).first.worker_id == "c0"
    assert blind.route(_request(), Candidates(shared, [], {"c0": 63})).first.worker_id != "c0"
    # a deeper queue is a hotspot there too
    deeper = _on_board(workers(5000))
    assert pol.route(_request(), Candidates(deeper, [], {"c0": 63})).first.worker_id != "c0"


@pytest.mark.parametrize("seed", range(3))
def test_cost_grows_the_batch_a_worker_steps_rather_than_wake_one_on_a_full_board(seed: int) -> None:
    pol = make_policy("cost", seed=seed, conditional_disaggregation=False)
    p, d = _two_by_two()
    held = {"p0": 63, "p1": 63}
    assert pol.route(_request(), Candidates(p, d, held)).decode.worker_id == "d1"  # cores of their own
    _on_board(p + d)
    assert pol.route(_request(), Candidates(p, d, held)).decode.worker_id == "d0"
    blind = make_policy("cost", seed=seed, conditional_disaggregation=False, share_weight=0)
    assert blind.route(_request(), Candidates(p, d, held)).decode.worker_id == "d1"
    p[0].load.reported_pending_prefill = 0  # room on the board for one more step: the idle one again
    assert pol.route(_request(), Candidates(p, d, held)).decode.worker_id == "d1"


@pytest.mark.parametrize("seed", range(3))
def test_a_mate_whose_sequences_are_near_their_end_does_not_keep_a_new_prompt_off_an_idle_worker(seed: int) -> None:
    """Two cores: c0 steps its queue, c1 decodes two sequences, c2 is idle. A prompt nobody holds
    (1k tokens, about 0.5 s) waking c2 makes three threads on two cores only while c1's sequences
    have tokens left. With two left each they are done in two steps: c2 takes it. With sixteen
    each, or where other fronts' requests may be there too (the count unknown), c1's batch keeps
    the board full: the prompt joins c1's steps, as it did before the count was kept."""

    def board(left: int | None) -> list[Fake]:
        c = _on_board([_worker("c0", "colocated", pending=400, running=3), _worker("c1", "colocated", running=2),
                       _worker("c2", "colocated")])
        if left is not None:  # the only front: its counts are the worker's
            c[1].load.sole_front, c[1].load.outstanding, c[1].load.local_decode_left = True, 2, left
        return c

    m = CostModel()
    assert m.busy_s(board(None)[1], 1.0, board(None)) == 1.0
    near_end = board(4)
    assert m.busy_s(near_end[1], 1.0, near_end) == pytest.approx(2 * (0.02 + 2 * 0.002))
    pol = make_policy("cost", seed=seed)
    assert pol.route(_request(), Candidates(near_end, [], {})).first.worker_id == "c2"
    assert pol.route(_request(), Candidates(board(32), [], {})).first.worker_id == "c1"
    assert pol.route(_request(), Candidates(board(None), [], {})).first.worker_id == "c1"


def test_a_board_stretches_the_ttft_estimate_by_the_turns_the_prefill_waits_for() -> None:
    pol = make_policy("cost", seed=0)
    p = [_worker("p0")]
    d = [_worker("d0", "decode", running=4), _worker("d1", "decode", running=4)]
    alone = pol.route(_request(), Candidates(p, d, {"p0": 63})).estimated_ttft_s
    _on_board(p + d)
    shared = pol.route(_request(), Candidates(p, d, {"p0": 63})).estimated_ttft_s
    assert shared == pytest.approx(1.5 * alone)  # three single-thread steps on two cores


def test_a_local_prefill_s_ttft_counts_the_decodes_its_steps_carry_and_the_step_in_flight() -> None:
    m = CostModel()
    w = _worker("d0", "decode", running=10, decode=(0.02, 0.002))
    alone = _worker("d1", "decode", decode=(0.02, 0.002))
    request = _request(1024 + 40)
    compute = m.prefill_s(w, 40, [w])
    assert m.ttft_s(alone, request, 64, [alone]) == pytest.approx(compute)  # nothing decoding there
    # one step carries the tail and 10 decodes (2 ms each), after half of the 40 ms decode step in flight
    assert m.decoding_s(w, 40, [w]) == pytest.approx(10 * 0.002 + 0.5 * (0.02 + 10 * 0.002))
    assert m.ttft_s(w, request, 64, [w]) == pytest.approx(compute + 0.040)
    # behind a queue of prompts over a 512-token budget: 3 steps carry the decodes, none in flight
    w.load.reported_pending_prefill, w.load.step_token_budget = 1000, 512
    assert m.decoding_s(w, 40, [w]) == pytest.approx(3 * 10 * 0.002)
    # a one-term decode fit: a sequence costs what a prompt token does (mixed steps split by tokens)
    w.load.decode = _fit(0.03, 0.0)
    assert m.decoding_s(w, 40, [w]) == pytest.approx(3 * 10 / 2000)
    # a prefill worker's requests in flight wait for their shipment, not for decodes
    assert m.decoding_s(_worker("p0", running=10), 40, [w]) == 0.0
    # a prompt capped at 16 tokens a step takes a step a chunk: 3 for 40 tokens, as the queue does
    w.load.prefill_chunk = 16
    assert m.decoding_s(w, 40, [w]) == pytest.approx(3 * 10 / 2000)
    # and 7 for 100 tokens on an empty queue (after half the decode step in flight)
    w.load.reported_pending_prefill = 0
    assert m.decoding_s(w, 100, [w]) == pytest.approx(7 * 10 / 2000 + 0.5 * 0.03)


def test_a_worker_reports_its_step_token_budget_and_prefill_chunk() -> None:
    load = WorkerLoad()
    load.update({"step_token_budget": 2048, "prefill_chunk": 256})
    assert load.step_token_budget == 2048 and load.prefill_chunk == 256
    load.update({"step_token_budget": 2048})  # an older worker: no cap
    assert load.prefill_chunk == 0


def test_a_prompt_capped_to_a_chunk_a_step_holds_the_queue_for_its_first_chunk_only() -> None:
    w = _queued(_worker("p", pending=160), 5)
    w.load.prefill_chunk = 256
    assert CostModel.joined(w, 544) == (5.0, 256)
    assert CostModel.joined(w, 100) == (5.0, 100)
    w.load.step_token_budget = 0
    assert CostModel.joined(w, 544) == (5.0, 256)


def _step_moments(seed: int, overhead: float, n: int = 40) -> list[float]:
    """An engine's moments over ``n`` steps of prompts 0-1024 tokens long and 0-8 decodes: 0.5 ms a
    prompt token, 2 ms a decode and ``overhead`` a step."""
    import random

    from baton_serve.router.routing.rates import MOMENTS
    rng = random.Random(seed)
    m = [0.0] * MOMENTS
    for _ in range(n):
        p, d = rng.choice((0, 32, 1024)), rng.randint(0, 8)
        t = overhead + 0.0005 * p + 0.002 * d
        for i, v in enumerate((1, p, d, p * p, p * d, d * d, t, t * p, t * d)):
            m[i] += v
    return m


def _stepped(wid: str, hardware: str, seed: int, overhead: float) -> Fake:
    w = _worker(wid, "colocated")
    w.load.hardware = hardware
    w.load.step.observe([0.0] * len(_step_moments(seed, overhead, 0)))
    w.load.step.observe(_step_moments(seed, overhead))
    return w


def test_workers_on_the_same_hardware_fit_their_steps_together() -> None:
    m = CostModel(step_fit=True)
    cpu = "cpu:X:2 threads|bf16|m"
    # identical workers whose overheads came out 2x apart by chance: one fit of all their steps
    a, b = _stepped("c0", cpu, 0, 0.004), _stepped("c1", cpu, 1, 0.008)
    pool = [a, b]
    assert m.prefill_s(a, 100, pool) == pytest.approx(m.prefill_s(b, 100, pool))
    assert 0.004 < m.prefill_s(a, 0, pool) < 0.008
    alone = CostModel(step_fit=True, pool_fits=False)
    assert alone.prefill_s(a, 0, pool) == pytest.approx(0.004) and alone.prefill_s(b, 0, pool) == pytest.approx(0.008)
    # new steps move the pooled fit (it is cached only while no worker's steps changed)
    before = m.prefill_s(a, 0, pool)
    b.load.step.observe([x + y for x, y in zip(_step_moments(1, 0.008), _step_moments(2, 0.02))])
    assert m.prefill_s(a, 0, pool) > before
    # a worker on other hardware, or naming none, keeps its own fit
    b.load.hardware = "cuda:H200|bf16|m"
    assert m.prefill_s(a, 0, pool) == pytest.approx(0.004)
    a.load.hardware = ""
    assert m.prefill_s(a, 0, pool) == pytest.approx(0.004)


def _intervals(wid: str, hardware: str, prompts: list[int], role: str = "colocated",
               per_token: float = 0.0014, overhead: float = 0.03) -> Fake:
    """A worker whose prefill intervals each computed one of ``prompts`` in a step of ``overhead``
    + ``per_token`` a token: the interval fit it makes alone is whatever they tell apart."""
    w = _worker(wid, role)
    w.load.hardware, w.load.prefill = hardware, LinearCost()
    n = units = seconds = 0.0
    w.load.prefill.observe(n, units, seconds)
    for p in prompts:
        n, units, seconds = n + 1, units + p, seconds + overhead + per_token * p
        w.load.prefill.observe(n, units, seconds)
    return w


def test_workers_on_the_same_hardware_and_role_fit_their_intervals_together() -> None:
    cpu = "cpu:X:1 threads|bf16|m"
    # the holder of a hot prefix computes only its 32-token tails: alone, its intervals cannot tell a
    # step's overhead from the tokens' cost and put all of it on the tokens (1.7x the real rate)
    tails, whole = _intervals("c0", cpu, [32] * 30), _intervals("c1", cpu, [32, 1056, 32, 1056, 32])
    pool = [tails, whole]
    truth = 0.03 + 0.0014 * 1056
    alone = CostModel(pool_fits=False)
    assert alone.prefill_s(whole, 1056, pool) == pytest.approx(truth)
    assert alone.prefill_s(tails, 1056, pool) > 1.5 * truth
    m = CostModel()
    assert m.prefill_s(tails, 1056, pool) == pytest.approx(truth) and m.prefill_s(whole, 1056, pool) == pytest.approx(truth)
    # new intervals move the pooled fit (it is cached only while no worker's intervals changed)
    before = m.prefill_s(tails, 1056, pool)
    more = _intervals("c1", cpu, [1056] * 20, per_token=0.0028)
    whole.load.prefill = more.load.prefill
    assert m.prefill_s(tails, 1056, pool) > before
    # a worker of another role on that hardware (its prompts' time not shared with decodes), or one
    # naming no hardware, keeps its own fit
    whole.role = "prefill"
    assert m.prefill_s(tails, 1056, pool) == pytest.approx(alone.prefill_s(tails, 1056, pool))
    whole.role, tails.load.hardware = "colocated", ""
    assert m.prefill_s(tails, 1056, pool) == pytest.approx(alone.prefill_s(tails, 1056, pool))
    # a fit set by hand (no intervals behind it) is priced as set, and pools with nothing
    tails.load.hardware, whole.load.prefill = cpu, _fit(0.5, 0.01)
    assert m.prefill_s(whole, 100, pool) == pytest.approx(1.5)
    assert m.prefill_s(tails, 1056, pool) == pytest.approx(alone.prefill_s(tails, 1056, pool))


@pytest.mark.parametrize("seed", range(5))
def test_a_cold_prompt_is_not_sent_to_the_worker_whose_own_tails_fit_the_cheapest_tokens(seed: int) -> None:
    # the colocated run's decision 591 (2026-12-05): three idle-ish workers of one hardware whose
    # fits from their own tails priced a 1k-token prompt 0.5-3.7 s; the cheapest, decoding three
    # sequences where another decoded one, took 1.84 s against 0.90 estimated
    cpu = "cpu:X:1 threads|bf16|m"
    pool = [_intervals("c0", cpu, [32, 1056, 32] * 3),
            _intervals("c1", cpu, [16, 32, 48, 64] * 8, per_token=0.0005, overhead=0.09),
            _intervals("c2", cpu, [16, 32, 48, 64] * 8, per_token=0.0035, overhead=0.0)]
    pool[1].load.num_running, pool[2].load.num_running = 3, 1
    alone = make_policy("cost", seed=seed, pool_fits=False)
    assert alone.route(_request(1056), Candidates(pool, [])).first.worker_id == "c1"
    x = make_policy("cost", seed=seed).route(_request(1056), Candidates(pool, []))
    assert x.first.worker_id == "c0"  # equal rates: the worker decoding nothing
    ttfts = {wid: est for wid, _, _, est in x.considered}
    assert ttfts["c1"] > ttfts["c2"] > ttfts["c0"]
