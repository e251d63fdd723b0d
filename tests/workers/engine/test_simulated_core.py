"""``EngineCore.for_simulation``: the real scheduler, block manager, prefix cache, forks, parking and
KV hand-offs, with the forward pass a callback on a virtual clock and no model at all."""

from __future__ import annotations

import pytest
from baton_serve.workers.blocks.prefix_hash import CacheNamespace
from baton_serve.workers.engine.config import EngineConfig, SchedulerConfig
from baton_serve.workers.engine.core import EngineCore
from baton_serve.workers.engine.stats import engine_stats
from baton_serve.workers.errors import InvalidRequestError
from baton_serve.workers.sampling.params import SamplingParams

NS = CacheNamespace(model="sim", weights_hash="w", block_size=8)


class _Clock:
    """A virtual clock: the forward pass advances it by a fixed time a step plus a bit per token."""

    def __init__(self) -> None:
        self.now = 100.0
        self.spent = 0.0

    def forward(self, out) -> None:
        dt = 0.01 + 0.001 * out.num_batched_tokens
        self.now += dt
        self.spent += dt


def _core(clock: _Clock, blocks: int = 64, **sched) -> EngineCore:
    cfg = EngineConfig(block_size=8, scheduler=SchedulerConfig(max_num_batched_tokens=64, **sched))
    return EngineCore.for_simulation(cfg, blocks, [2], vocab_size=1000, max_model_len=256, forward=clock.forward,
                                     token_id=7, namespace=NS, clock=lambda: clock.now, timer=lambda: clock.now)


def _params(n_out: int, n: int = 1) -> SamplingParams:
    return SamplingParams(max_tokens=n_out, ignore_eos=True, n=n, seed=1 if n > 1 else None)


def _run(core: EngineCore, limit: int = 1000) -> list:
    deltas = []
    for _ in range(limit):
        if not core.has_unfinished_requests():
            return deltas
        deltas.extend(core.step())
    raise AssertionError("the engine did not finish")


def test_requests_end_at_their_length_and_steps_take_the_forwards_time():
    clock = _Clock()
    core = _core(clock)
    core.add_request("a", list(range(10, 40)), _params(5))
    core.add_request("b", list(range(50, 60)), _params(3))
    deltas = _run(core)
    by = {rid: [d for d in deltas if d.request_id == rid] for rid in ("a", "b")}
    assert [len(d.token_ids) for d in by["a"]] == [1] * 5 and [d.position for d in by["a"]] == list(range(5))
    assert by["a"][-1].finish_reason == "length" and by["b"][-1].finish_reason == "length"
    assert sum(len(d.token_ids) for d in by["b"]) == 3
    assert core.busy_seconds == pytest.approx(clock.spent)
    assert core.block_manager.num_free_blocks == 64 and not core.groups
    stats = engine_stats(core)
    assert stats.num_steps == core.num_steps and stats.num_free_blocks == 64


def test_the_injected_clock_stamps_arrival_first_token_and_end():
    clock = _Clock()
    core = _core(clock)
    core.add_request("a", list(range(10, 30)), _params(2))
    req = core._members["a"]
    assert req.arrival_time == 100.0
    core.step()
    assert req.first_token_time == clock.now
    _run(core)
    assert req.finished_time == clock.now


def test_a_shared_prefix_is_a_real_prefix_cache_hit_and_forks_share_it():
    clock = _Clock()
    core = _core(clock)
    prompt = list(range(100, 140))  # five full blocks
    core.add_request("a", prompt, _params(2))
    _run(core)
    core.add_request("b", prompt[:32] + [900, 901], _params(2, n=2))
    deltas = _run(core)
    assert {d.index for d in deltas} == {0, 1}
    assert max(d.num_cached_tokens for d in deltas) == 32
    assert core.block_manager.num_free_blocks == 64


def test_an_abort_frees_everything():
    clock = _Clock()
    core = _core(clock)
    core.add_request("a", list(range(10, 100)), _params(50))
    core.step()
    core.abort_request("a")
    assert not core.has_unfinished_requests() and core.block_manager.num_free_blocks == 64


def test_a_parked_prefill_moves_to_a_decode_core_which_skips_the_blocks_it_holds():
    clock = _Clock()
    prefill, decode = _core(clock), _core(clock)
    prompt = list(range(200, 241))  # 41 tokens: five full blocks and one more
    decode.add_request("warm", prompt[:24] + [5], _params(1))  # the decode side caches three blocks of it
    _run(decode)
    prefill.add_request("r", prompt, _params(4), prefill_only=True)
    first = prefill.step()
    assert len(first) == 1 and first[0].kv_ready and "r" in prefill.parked
    meta, table = prefill.migration_meta("r")
    needed = decode.reserve_remote(meta)
    assert needed == [3, 4, 5]  # blocks 0-2 came from its own cache
    decode.admit_remote("r")
    assert prefill.release_parked("r") and prefill.block_manager.num_free_blocks == 64
    rest = _run(decode)
    assert sum(len(d.token_ids) for d in rest) == 3 and rest[-1].finish_reason == "length"
    assert decode.block_manager.num_free_blocks == 64 and not decode.incoming


def test_a_grammar_request_is_refused_without_a_tokenizer():
    core = _core(_Clock())
    with pytest.raises(InvalidRequestError):
        core.add_request("g", [10, 11, 12], SamplingParams(max_tokens=4, structured_outputs={"regex": "[ab]+"}))
    assert not core.has_unfinished_requests()
