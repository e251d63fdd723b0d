"""Engine behaviour: validation, stop conditions, n > 1, seeds, logprobs, aborts, KV accounting."""

from __future__ import annotations

import pytest
from baton_serve.workers import LLM, SamplingParams
from baton_serve.workers.errors import ContextLengthExceededError, InvalidRequestError, OutOfBlocksError

NUM_BLOCKS = 96


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(model=str(tiny_model_dir), dtype="float32", block_size=8, num_kv_blocks=NUM_BLOCKS,
               max_num_batched_tokens=64)


def _greedy(**kw) -> SamplingParams:
    kw.setdefault("max_tokens", 12)
    return SamplingParams(temperature=0.0, ignore_eos=True, **kw)


def _assert_idle(llm: LLM) -> None:
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.num_running == 0 and llm.engine.num_waiting == 0
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == NUM_BLOCKS
    assert bm.usage == 0.0


@pytest.mark.parametrize(
    "make",
    [
        lambda: SamplingParams(temperature=-0.5),
        lambda: SamplingParams(top_p=0.0),
        lambda: SamplingParams(top_p=1.5),
        lambda: SamplingParams(max_tokens=0),
        lambda: SamplingParams(min_p=2.0),
        lambda: SamplingParams(n=0),
        lambda: SamplingParams(min_tokens=5, max_tokens=2),
    ],
)
def test_bad_sampling_params_raise_typed_errors(make):
    with pytest.raises(InvalidRequestError) as info:
        make()
    assert info.value.param


def test_bad_requests_raise_and_leave_nothing_allocated(llm):
    cases = [
        ([], _greedy(), InvalidRequestError, "prompt"),
        ([10**6], _greedy(), InvalidRequestError, "prompt"),
        ([5] * 600, _greedy(), ContextLengthExceededError, "prompt"),
        ([5] * 10, _greedy(max_tokens=600), ContextLengthExceededError, "max_tokens"),
        ([5] * 10, SamplingParams(logit_bias={10**6: 1.0}), InvalidRequestError, "logit_bias"),
        ([5] * 10, SamplingParams(stop_token_ids=[-1]), InvalidRequestError, "stop_token_ids"),
    ]
    for prompt, params, exc, param in cases:
        with pytest.raises(exc) as info:
            llm.generate([prompt], params)
        assert info.value.param == param
        _assert_idle(llm)
    # a batch with one bad prompt is rejected as a whole before any work starts
    with pytest.raises(InvalidRequestError):
        llm.generate([[5, 6, 7], []], _greedy())
    _assert_idle(llm)
    assert llm.generate([[5, 6, 7]], _greedy(max_tokens=2))[0].outputs[0].finish_reason == "length"


def test_prompt_larger_than_the_whole_cache_is_rejected(tiny_model_dir):
    small = LLM(model=str(tiny_model_dir), dtype="float32", block_size=8, num_kv_blocks=4)
    with pytest.raises(OutOfBlocksError):
        small.generate([[5] * 40], _greedy())
    assert small.engine.block_manager.num_free_blocks == 4


def test_length_stop_eos_and_stop_token_ids(llm):
    prompt = llm.tokenizer.encode("Hello world! How are you")
    base = llm.generate([prompt], _greedy(max_tokens=8))[0].outputs[0]
    assert base.finish_reason == "length" and len(base.token_ids) == 8
    stop_tok = base.token_ids[3]
    first = base.token_ids.index(stop_tok)
    out = llm.generate([prompt], _greedy(max_tokens=8, stop_token_ids=[stop_tok]))[0].outputs[0]
    assert out.token_ids == base.token_ids[: first + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop_tok)
    # EOS: make the first greedy token the model's EOS through a logit bias
    eos = llm.engine.eos_token_ids
    eos_id = min(eos)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, logit_bias={eos_id: 100}))[0]
    assert out.outputs[0].token_ids == [eos_id] and out.outputs[0].finish_reason == "stop"
    # ignore_eos keeps going
    out = llm.generate([prompt], _greedy(max_tokens=3, logit_bias={eos_id: 100}))[0]
    assert out.outputs[0].token_ids == [eos_id] * 3 and out.outputs[0].finish_reason == "length"
    _assert_idle(llm)


def test_min_tokens_suppresses_stop_tokens(llm):
    prompt = llm.tokenizer.encode("The quick brown fox")
    base = llm.generate([prompt], _greedy(max_tokens=6))[0].outputs[0]
    stop_tok = base.token_ids[0]
    out = llm.generate([prompt], _greedy(max_tokens=6, stop_token_ids=[stop_tok], min_tokens=3))[0]
    toks = out.outputs[0].token_ids
    assert len(toks) >= 3 and stop_tok not in toks[:3]
    _assert_idle(llm)


def test_stop_strings_across_token_boundaries(llm):
    prompt = llm.tokenizer.encode("Paris is the capital of")
    base = llm.generate([prompt], _greedy(max_tokens=12))[0].outputs[0]
    text = base.text
    pieces = [llm.tokenizer.decode([t]) for t in base.token_ids]
    # a stop string that starts inside one token and ends inside a later one
    start = len(pieces[0]) + len(pieces[1]) - 1
    stop = text[start: start + len(pieces[2]) + 2]
    assert len(stop) >= 2 and stop not in text[:start]
    out = llm.generate([prompt], _greedy(max_tokens=12, stop=[stop]))[0].outputs[0]
    assert out.text == text[: text.index(stop)]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    assert len(out.token_ids) < len(base.token_ids)
    kept = llm.generate([prompt], _greedy(max_tokens=12, stop=[stop], include_stop_str_in_output=True))[0]
    assert kept.outputs[0].text == text[: text.index(stop) + len(stop)]
    _assert_idle(llm)


def test_seed_reproducible_regardless_of_batch(llm):
    prompt = llm.tokenizer.encode("Hello world")
    params = SamplingParams(temperature=1.0, seed=1234, max_tokens=10, ignore_eos=True)
    alone = llm.generate([prompt], params)[0].outputs[0].token_ids
    others = [llm.tokenizer.encode(p) for p in ("你好", "def f():", "The quick")]
    mixed = llm.generate([others[0], prompt, others[1], others[2]],
                         [SamplingParams(temperature=0.9, max_tokens=7), params,
                          SamplingParams(temperature=0.5, max_tokens=13), _greedy()])
    assert mixed[1].outputs[0].token_ids == alone
    other_seed = SamplingParams(temperature=1.0, seed=99, max_tokens=10, ignore_eos=True)
    assert llm.generate([prompt], other_seed)[0].outputs[0].token_ids != alone
    _assert_idle(llm)


def test_parallel_sampling_n_shares_prompt_blocks(llm):
    prompt = llm.tokenizer.encode("Emoji test 🙂👍🏽 and more text here")  # ends mid-block
    assert len(prompt) % 8
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=9, ignore_eos=True)
    out = llm.generate([prompt], params)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 9 and c.finish_reason == "length" for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    again = llm.generate([prompt], params)[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]
    greedy = llm.generate([prompt], _greedy(n=2, max_tokens=6))[0]
    single = llm.generate([prompt], _greedy(max_tokens=6))[0]
    assert greedy.outputs[0].token_ids == greedy.outputs[1].token_ids == single.outputs[0].token_ids
    _assert_idle(llm)


def test_logprobs_and_top_logprobs(llm):
    prompt = llm.tokenizer.encode("Hello")
    out = llm.generate([prompt], _greedy(max_tokens=5, logprobs=3))[0].outputs[0]
    assert len(out.logprobs) == 5 and len(out.top_logprobs) == 5
    for tok, lp, top in zip(out.token_ids, out.logprobs, out.top_logprobs):
        assert len(top) == 3
        assert top[0][0] == tok and top[0][1] == pytest.approx(lp, abs=1e-5)
        assert [v for _, v in top] == sorted((v for _, v in top), reverse=True)
        assert lp <= 0.0


def test_abort_mid_stream_frees_every_block(llm):
    engine = llm.engine
    prompts = [llm.tokenizer.encode(p) for p in ("Hello world", "你好，世界", "def add(a, b):", "The")]
    for i, p in enumerate(prompts):
        engine.add_request(f"a{i}", p, _greedy(max_tokens=30))
    for _ in range(4):
        engine.step()
    assert engine.block_manager.num_free_blocks < NUM_BLOCKS
    deltas = engine.abort_request(["a0", "a2", "missing"])
    assert sorted(d.request_id for d in deltas) == ["a0", "a2"]
    assert all(d.finish_reason == "abort" for d in deltas)
    assert engine.abort_request("a0") == []  # idempotent
    while engine.has_unfinished_requests():
        for d in engine.step():
            assert d.request_id in ("a1", "a3")
    _assert_idle(llm)


def test_context_limit_finishes_with_length(tiny_model_dir):
    small = LLM(model=str(tiny_model_dir), dtype="float32", block_size=8, num_kv_blocks=64,
                max_model_len=24)
    out = small.generate([[5] * 20], SamplingParams(temperature=0, max_tokens=None, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 4 and out.outputs[0].finish_reason == "length"


def test_pause_keeps_kv_and_resume_continues_exactly(llm):
    """Backpressure: a paused request gets no steps but keeps its blocks; output is unchanged."""
    engine = llm.engine
    prompt = llm.tokenizer.encode("Hello world! How are you today?")
    expected = llm.generate([prompt], _greedy(max_tokens=10))[0].outputs[0].token_ids
    engine.add_request("slow", prompt, _greedy(max_tokens=10))
    engine.add_request("other", prompt[:5], _greedy(max_tokens=10))
    got: list[int] = []
    for _ in range(3):
        got += [t for d in engine.step() if d.request_id == "slow" for t in d.token_ids]
    held = NUM_BLOCKS - engine.block_manager.num_free_blocks
    assert engine.pause_request("slow") == 1
    for _ in range(4):
        assert all(d.request_id != "slow" for d in engine.step())
    assert NUM_BLOCKS - engine.block_manager.num_free_blocks >= held - 2  # "other" may have finished
    assert engine.resume_request("slow") == 1
    while engine.has_unfinished_requests():
        got += [t for d in engine.step() if d.request_id == "slow" for t in d.token_ids]
    assert got == expected
    engine.add_request("gone", prompt, _greedy(max_tokens=10))
    engine.step()
    engine.pause_request("gone")
    engine.abort_request("gone")
    _assert_idle(llm)
    assert not engine.paused


def test_auto_dtype_resolves_once_for_the_whole_engine(tiny_model_dir) -> None:
    """``dtype="auto"`` (the default) becomes this machine's choice everywhere: the config the
    engine reports, the weights, the KV cache and the prefix-cache namespace."""
    from baton_serve.kernels.auto_dtype import resolve_dtype

    want = resolve_dtype("auto").dtype
    llm = LLM(model=str(tiny_model_dir), block_size=8, num_kv_blocks=NUM_BLOCKS)
    assert llm.config.dtype == llm.engine.config.dtype == want
    assert str(llm.engine.model.dtype) == f"torch.{want}"
    assert llm.engine.block_manager.namespace.kv_dtype == want


def test_step_moments_sum_every_step_for_the_routers_step_fit(llm):
    """n, P, D, PP, PD, DD, t, tP, tD over the steps: the counts agree with the engine's totals."""
    e = llm.engine
    before = list(e.step_moments)
    steps, prefill, decode, busy = e.num_steps, e.num_prefill_tokens_computed, e.num_decode_tokens_computed, \
        e.busy_seconds
    prompts = [llm.tokenizer.encode(t) for t in ("Hello world! How are you today?", "def f(x):", "a b c d e f g")]
    llm.generate(prompts, _greedy(max_tokens=5))
    m = [a - b for a, b in zip(e.step_moments, before)]
    assert m[0] == e.num_steps - steps > 0
    assert m[1] == e.num_prefill_tokens_computed - prefill > 0
    assert m[2] == e.num_decode_tokens_computed - decode > 0
    assert m[6] == pytest.approx(e.busy_seconds - busy)
    assert m[3] >= m[1] ** 2 / m[0] and m[5] >= m[2] ** 2 / m[0]  # sums of squares, not squared sums
    assert 0 < m[7] and 0 < m[8]
