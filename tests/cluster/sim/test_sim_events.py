"""The simulator's clock, core board and workload: the parts that decide when things happen."""

from __future__ import annotations

import math

from baton_serve.cluster.bench.runner import BenchConfig
from baton_serve.cluster.bench.workload import LengthDist, WorkloadConfig
from baton_serve.cluster.sim.board import CoreBoard
from baton_serve.cluster.sim.events import EventLoop
from baton_serve.cluster.sim.requests import build_workload


def test_events_run_in_time_order_and_ties_in_the_order_scheduled():
    loop, seen = EventLoop(), []
    loop.at(2.0, lambda: seen.append(("b", loop.now)))
    loop.at(1.0, lambda: seen.append(("a", loop.now)))
    loop.at(2.0, lambda: seen.append(("c", loop.now)))
    loop.at(1.0, lambda: loop.after(0.5, lambda: seen.append(("d", loop.now))))
    loop.run()
    assert seen == [("a", 1.0), ("d", 1.5), ("b", 2.0), ("c", 2.0)]
    loop.at(0.0, lambda: seen.append(("late", loop.now)))  # the past: runs now
    loop.run()
    assert seen[-1] == ("late", 2.0)


def test_run_stops_when_asked_and_at_the_time_limit():
    loop, seen = EventLoop(), []
    for t in range(10):
        loop.at(float(t), lambda t=t: seen.append(t))
    loop.run(until=lambda: len(seen) == 3)
    assert seen == [0, 1, 2]
    loop.run(max_time_s=5.5)
    assert seen == [0, 1, 2, 3, 4, 5] and loop.now == 5.5


def test_a_board_gives_turns_in_the_order_asked_and_never_more_cores_than_it_has():
    board, started = CoreBoard("b", cores=2), []
    board.ask(2, lambda: started.append("a"))
    board.ask(1, lambda: started.append("b"))
    board.ask(1, lambda: started.append("c"))  # fits beside b, but only once b's turn came
    assert started == ["a"] and board.running == 2
    board.give_back(2)
    assert started == ["a", "b", "c"] and board.running == 2
    board.give_back(1)
    board.ask(2, lambda: started.append("d"))  # needs both: waits for c
    assert started == ["a", "b", "c"]
    board.give_back(1)
    assert started[-1] == "d"


def test_the_simulated_workload_has_the_bench_lengths_prefixes_and_schedule():
    cfg = BenchConfig(workload=WorkloadConfig(name="shared-prefix", input_len=LengthDist(32),
                                              output_len=LengthDist(8), num_prefixes=3, prefix_len=64),
                      num_prompts=30, request_rate=4.0, seed=5, warmup_prefixes=True)
    wl = build_workload(cfg)
    assert len(wl.requests) == 30 and all(len(r.prompt_token_ids) == 96 and r.output_len == 8 for r in wl.requests)
    heads = {tuple(r.prompt_token_ids[:64]) for r in wl.requests}
    tails = {tuple(r.prompt_token_ids[64:]) for r in wl.requests}
    assert len(heads) == 3 and len(tails) == 30  # three shared system prompts, every user turn fresh
    warm_heads = {tuple(w.prompt_token_ids[:64]) for w in wl.warmups[1:]}
    assert warm_heads == heads and not {tuple(w.prompt_token_ids[64:]) for w in wl.warmups} & tails
    arrivals = [r.arrival_s for r in wl.requests]
    assert arrivals[0] == 0.0 and arrivals == sorted(arrivals) and 3 < arrivals[-1] < 20
    again = build_workload(cfg)
    assert [r.prompt_token_ids for r in again.requests] == [r.prompt_token_ids for r in wl.requests]
    closed = build_workload(BenchConfig(num_prompts=4, request_rate=math.inf, max_concurrency=2))
    assert closed.users == 2 and all(r.arrival_s is None for r in closed.requests)
