"""Batched sampler: filter semantics (seed §3.1-3.3, D01/D02), draws, seeding, logprobs."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from baton_serve.workers.errors import InvalidRequestError
from baton_serve.workers.sampling.ops import (
    apply_min_p,
    apply_penalties,
    apply_temperature,
    apply_top_k,
    apply_top_p,
    apply_typical_p,
    inverse_cdf_sample,
    truncation_window,
)
from baton_serve.workers.sampling.params import SamplingParams
from baton_serve.workers.sampling.sampler import Sampler, SamplerOutput, SamplingRow, process_logits
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from scipy.stats import chisquare

torch.set_num_threads(1)

PROPERTY = settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])


def row(prompt=(), output=(), generator=None, suppress=(), **params) -> SamplingRow:
    return SamplingRow(SamplingParams(**params), list(prompt), list(output), generator, list(suppress))


def support(logits: torch.Tensor) -> set[int]:
    return set(torch.nonzero(torch.isfinite(logits.reshape(-1))).reshape(-1).tolist())


def lp(probs) -> torch.Tensor:
    """[1, V] logits whose softmax is ``probs``."""
    return torch.log(torch.tensor([probs], dtype=torch.float32))


def t1(*values) -> torch.Tensor:
    return torch.tensor(values)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------- seed D01 / D02


def test_d01_top_p_keeps_boundary_token():
    p_ex = [0.4, 0.3, 0.2, 0.1]
    assert support(apply_top_p(lp(p_ex), t1(0.65))) == {0, 1}  # cumulative 0.7 >= 0.65
    assert sum([p_ex[0]]) < 0.65  # "strictly below p" alone would drop the boundary token


def test_d01_min_p_support_grows_with_temperature():
    logits = torch.tensor([[4.0, 3.2, 2.5, 1.9, 1.0, 0.2, -0.8, -2.0]])
    sizes = [len(support(apply_min_p(apply_temperature(logits, t1(t)), t1(0.3)))) for t in (0.2, 0.5, 1.0, 2.0, 5.0)]
    assert sizes == sorted(sizes) and sizes[0] < sizes[-1]


def test_d02_filter_order_is_not_commutative():
    probs = lp([0.45, 0.3, 0.12, 0.08, 0.05])
    k_then_p = support(apply_top_p(apply_top_k(probs, t1(3)), t1(0.8)))
    p_then_k = support(apply_top_k(apply_top_p(probs, t1(0.8)), t1(3)))
    assert k_then_p == {0, 1} and p_then_k == {0, 1, 2}
    # The pipeline runs top-k first: token 2 can never be drawn.
    with torch.random.fork_rng():
        torch.manual_seed(0)
        out = Sampler()(probs.expand(400, -1), [row(top_k=3, top_p=0.8) for _ in range(400)])
    assert set(out.token_ids.tolist()) == {0, 1}


def test_d01_greedy_tie_breaks_to_lowest_id_and_t0_is_argmax():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [0.0, -1.0, 5.0, 5.0]])
    out = Sampler()(logits, [row(temperature=0.0), row(temperature=0.0)])
    assert out.token_ids.tolist() == [1, 2]
    rand = torch.randn(16, 100)
    out = Sampler()(rand, [row(temperature=0.0, top_k=3, top_p=0.5) for _ in range(16)])
    assert torch.equal(out.token_ids, rand.argmax(-1))  # filters never move the greedy pick


def test_d01_negative_temperature_rejected():
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(temperature=-0.5)
    assert err.value.param == "temperature"


# ------------------------------------------------------------ exact support sets


def test_top_k_support_per_row_and_disabled_values():
    logits = torch.tensor([[1.0, 5.0, 3.0, 4.0, 2.0]]).expand(4, -1)
    out = apply_top_k(logits, t1(2, 0, 5, -1))
    assert support(out[0]) == {1, 3}
    assert all(support(out[i]) == set(range(5)) for i in (1, 2, 3))
    tied = torch.tensor([[1.0, 3.0, 3.0, 0.0]])
    assert support(apply_top_k(tied, t1(1))) == {1, 2}  # ties with the k-th are kept
    assert torch.equal(out[0, [1, 3]], logits[0, [1, 3]])  # kept values untouched


@pytest.mark.parametrize(("p", "kept"), [(0.69, {0, 1}), (0.71, {0, 1, 2}), (0.01, {0}), (1.0, {0, 1, 2, 3})])
def test_top_p_boundary(p, kept):
    assert support(apply_top_p(lp([0.4, 0.3, 0.2, 0.1]), t1(p))) == kept


def test_top_p_support_is_order_independent():
    assert support(apply_top_p(lp([0.1, 0.2, 0.4, 0.3]), t1(0.65))) == {2, 3}


@pytest.mark.parametrize(("m", "kept"), [(0.25, {0, 1, 2}), (0.35, {0, 1}), (0.0, {0, 1, 2, 3, 4}), (1.0, {0})])
def test_min_p_support(m, kept):
    assert support(apply_min_p(lp([0.5, 0.2, 0.15, 0.1, 0.05]), t1(m))) == kept


@pytest.mark.parametrize(("tau", "kept"), [(0.2, {1}), (0.45, {1, 2}), (0.55, {0, 1, 2}), (1.0, {0, 1, 2, 3})])
def test_typical_p_support(tau, kept):
    # H = 1.2799; |-log p - H| = .364, .076, .329, 1.023 -> rank order 1, 2, 0, 3
    assert support(apply_typical_p(lp([0.4, 0.3, 0.2, 0.1]), t1(tau))) == kept


def test_logit_bias_allowed_banned():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).expand(5, -1)
    rows = [
        row(logit_bias={2: 2.5}),
        row(logit_bias={2: 1.5, 0: -100.0}),
        row(allowed_token_ids=[1, 3]),
        row(banned_token_ids=[0, 1]),
        row(allowed_token_ids=[0, 3], banned_token_ids=[0]),
    ]
    z = process_logits(logits, rows)
    assert z[0].tolist() == [2.0, 1.0, 2.5, -1.0]
    assert z[1].tolist() == [-98.0, 1.0, 1.5, -1.0]
    assert support(z[2]) == {1, 3} and support(z[3]) == {2, 3} and support(z[4]) == {3}
    many = Sampler()(logits[:1].expand(5 * 200, -1), rows * 200).token_ids.reshape(200, 5)
    for i in (2, 3, 4):
        assert set(many[:, i].tolist()) <= support(z[i])


def test_greedy_respects_bias_and_masks():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).expand(4, -1)
    rows = [
        row(temperature=0, logit_bias={2: 2.5}),
        row(temperature=0, logit_bias={2: 1.5}),
        row(temperature=0, allowed_token_ids=[1, 3]),
        row(temperature=0, banned_token_ids=[0, 1]),
    ]
    assert Sampler()(logits, rows).token_ids.tolist() == [2, 0, 1, 2]


def test_min_tokens_suppression_masks_eos():
    logits = torch.tensor([[0.0, 1.0, 0.5, 0.2, 0.1, 9.0]])
    eos = 5
    held = row(temperature=0, min_tokens=3, output=[1], suppress=[eos])
    assert Sampler()(logits, [held]).token_ids.item() != eos
    sampled = [row(min_tokens=3, output=[1], suppress=[eos]) for _ in range(300)]
    assert eos not in Sampler()(logits.expand(300, -1), sampled).token_ids.tolist()
    free = row(temperature=0, min_tokens=3, output=[1, 2, 3])  # engine stops suppressing
    assert Sampler()(logits, [free]).token_ids.item() == eos


def test_unsatisfiable_constraints_fall_back_to_raw_logits():
    logits = torch.tensor([[0.0, 3.0, 1.0]])
    dead = row(temperature=0, allowed_token_ids=[2], suppress=[2])
    assert torch.equal(process_logits(logits, [dead]), logits)
    assert Sampler()(logits, [dead]).token_ids.item() == 1


def test_repetition_penalty_is_sign_aware_and_only_for_seen_tokens():
    logits = torch.tensor([[2.0, -2.0, 1.0, -1.0, 0.5]])
    out = apply_penalties(logits, [[0]], [[1]], t1(2.0), t1(0.0), t1(0.0))
    assert out.tolist() == [[1.0, -4.0, 1.0, -1.0, 0.5]]  # 0 (prompt) divided, 1 (output) multiplied
    assert logits.tolist() == [[2.0, -2.0, 1.0, -1.0, 0.5]]  # pure


def test_frequency_presence_count_output_only():
    logits = torch.zeros(1, 4)
    out = apply_penalties(logits, [[2, 2, 2]], [[0, 0, 1]], t1(1.0), t1(0.5), t1(0.25))
    assert out.tolist() == [[-1.25, -0.75, 0.0, 0.0]]  # prompt token 2 is not counted
    both = apply_penalties(torch.tensor([[2.0, 1.0]]), [[]], [[0, 0]], t1(2.0), t1(0.5), t1(0.0))
    assert both.tolist() == [[0.0, 1.0]]  # repetition first (2 -> 1), then 1 - 0.5 * 2


def test_sampler_applies_penalties_per_row():
    logits = torch.tensor([[3.0, 2.9, 0.0]]).expand(3, -1)
    rows = [
        row(temperature=0, repetition_penalty=1.5, prompt=[0]),
        row(temperature=0, frequency_penalty=0.2, output=[0]),
        row(temperature=0, presence_penalty=0.05, output=[0]),
    ]
    assert Sampler()(logits, rows).token_ids.tolist() == [1, 1, 0]


# ------------------------------------------------------------- empirical draws


def ref_distribution(z: np.ndarray, t: float, k: int = 0, p: float = 1.0, m: float = 0.0, tau: float = 1.0):
    """float64 reference of the pipeline's steps 3-4 on one row."""
    probs = np.exp(z / t - np.max(z / t))
    probs /= probs.sum()
    if 0 < k < len(z):
        probs[probs < np.sort(probs)[::-1][k - 1]] = 0
        probs /= probs.sum()
    order = np.argsort(-probs, kind="stable")
    excl = np.concatenate([[0.0], np.cumsum(probs[order])[:-1]])
    probs[order[excl >= p]] = 0
    probs /= probs.sum()
    probs[probs < m * probs.max()] = 0
    probs /= probs.sum()
    if tau < 1:
        nz = probs > 0
        logp = np.where(nz, np.log(np.where(nz, probs, 1)), -np.inf)
        score = np.abs(-logp - (-(probs[nz] * logp[nz]).sum()))
        order = np.argsort(score, kind="stable")
        excl = np.concatenate([[0.0], np.cumsum(probs[order])[:-1]])
        probs[order[excl >= tau]] = 0
        probs /= probs.sum()
    return probs


@pytest.mark.parametrize(
    "cfg",
    [
        dict(temperature=0.7, top_k=5, top_p=0.8),
        dict(temperature=1.3, top_p=0.9),
        dict(temperature=1.2, min_p=0.15),
        dict(temperature=1.0, typical_p=0.8, top_k=6),
    ],
)
def test_empirical_frequencies_match_filtered_distribution(cfg):
    z = np.array([2.0, 1.5, 1.0, 0.7, 0.3, 0.0, -0.5, -1.0])
    expected = ref_distribution(
        z, cfg["temperature"], cfg.get("top_k", 0), cfg.get("top_p", 1.0), cfg.get("min_p", 0.0), cfg.get("typical_p", 1.0)
    )
    n = 20000
    with torch.random.fork_rng():
        torch.manual_seed(1234)
        out = Sampler()(torch.tensor(z, dtype=torch.float32).expand(n, -1), [row(**cfg) for _ in range(n)])
    counts = np.bincount(out.token_ids.numpy(), minlength=len(z))
    kept = expected > 0
    assert 2 <= kept.sum() < len(z)
    assert counts[~kept].sum() == 0  # filtered tokens are never drawn
    assert chisquare(counts[kept], expected[kept] * n).pvalue > 1e-3


def test_blocked_inverse_cdf_matches_distribution_and_flat_search():
    probs = torch.tensor([0.0, 0.1, 0.0, 0.05, 0, 0, 0, 0, 0.3, 0.0, 0.15, 0.1, 0.2, 0.1, 0.0, 0.0])
    n = 20000
    u = torch.rand(n, dtype=torch.float64, generator=gen(7))
    blocked = inverse_cdf_sample(probs.expand(n, -1), u, block=4)
    assert torch.equal(blocked, inverse_cdf_sample(probs.expand(n, -1), u, block=1024))
    counts = np.bincount(blocked.numpy(), minlength=16)
    kept = probs.numpy() > 0
    assert counts[~kept].sum() == 0
    assert chisquare(counts[kept], probs.numpy()[kept] / probs.sum().item() * n).pvalue > 1e-3
    edge = torch.tensor([0.0, 0.0, 1.0, 0.0, 0.0, 2.0, 0.0, 0.0, 0.0])
    ends = inverse_cdf_sample(edge.expand(2, -1), torch.tensor([0.0, 1.0 - 2.0**-53]), block=2)
    assert ends.tolist() == [2, 5]


# -------------------------------------------------------------------- seeding


def _steps(seed: int, neighbours: bool, cfg: dict, steps: int = 8) -> list[int]:
    g = gen(seed)
    logits_gen = gen(99)
    tokens = []
    for step in range(steps):
        logits = torch.randn(5, 300, generator=logits_gen) * 2
        target = row(generator=g, **cfg)
        if not neighbours:
            tokens.append(Sampler()(logits[2:3], [target]).token_ids.item())
            continue
        rows = [
            row(temperature=0),
            row(top_k=150, generator=gen(1000 + step)),
            target,
            row(top_p=0.5, logit_bias={3: 5.0}, repetition_penalty=1.3, prompt=[1, 2]),
            row(min_p=0.1, temperature=0.5),
        ]
        tokens.append(Sampler()(logits, rows).token_ids[2].item())
    return tokens


@pytest.mark.parametrize("cfg", [dict(top_p=0.9), dict(top_k=20, temperature=0.8), dict(temperature=1.1), dict()])
def test_same_seed_same_tokens_regardless_of_batch(cfg):
    alone = _steps(42, neighbours=False, cfg=cfg)
    assert alone == _steps(42, neighbours=True, cfg=cfg)
    assert alone != _steps(43, neighbours=False, cfg=cfg)


def test_different_seeds_give_different_sequences():
    logits = torch.zeros(1, 1000)
    seqs = []
    for seed in (1, 2):
        g = gen(seed)
        seqs.append([Sampler()(logits, [row(generator=g)]).token_ids.item() for _ in range(20)])
    assert seqs[0] != seqs[1]


# ------------------------------------------------------------------- logprobs


def test_logprobs_are_raw_log_softmax():
    raw = (torch.randn(6, 50, generator=gen(3)) * 3).to(torch.bfloat16)
    rows = [
        row(temperature=0, logprobs=3),
        row(repetition_penalty=1.5, prompt=[1, 2], logprobs=5),
        row(logit_bias={7: 50.0}, temperature=0.3),
        row(top_k=4, top_p=0.7, logprobs=0),
        row(allowed_token_ids=[10, 11]),
        row(temperature=2.0, min_p=0.2, logprobs=1),
    ]
    out = Sampler()(raw, rows)
    ref = torch.log_softmax(raw.float(), -1)
    assert out.token_ids.dtype == torch.int64 and out.logprobs.dtype == torch.float32
    torch.testing.assert_close(out.logprobs, ref.gather(1, out.token_ids[:, None]).squeeze(1), rtol=0, atol=1e-6)
    assert out.token_ids[2].item() == 7 and out.token_ids[4].item() in (10, 11)
    assert out.top_logprob_ids.shape == (6, 5) and out.top_logprobs.dtype == torch.float32
    vals, ids = torch.topk(ref, 5)
    torch.testing.assert_close(out.top_logprobs, vals, rtol=0, atol=1e-6)
    assert torch.equal(out.top_logprob_ids, ids)
    assert bool((out.top_logprobs[:, :-1] >= out.top_logprobs[:, 1:]).all())


def test_no_top_logprobs_unless_asked():
    out = Sampler()(torch.randn(3, 20), [row(), row(temperature=0, logprobs=0), row(top_k=2)])
    assert out.top_logprob_ids is None and out.top_logprobs is None


# ---------------------------------------------------------------- fast paths


def test_all_greedy_plain_batch_takes_fast_path(monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("fast path must not process or sample")

    monkeypatch.setattr("baton_serve.workers.sampling.sampler._process", boom)
    monkeypatch.setattr(Sampler, "_sample", boom)
    logits = torch.randn(8, 64)
    out = Sampler()(logits, [row(temperature=0, top_p=0.5, top_k=3) for _ in range(8)])
    assert torch.equal(out.token_ids, logits.argmax(-1))
    with pytest.raises(AssertionError):
        Sampler()(logits, [row(temperature=0, logit_bias={1: 1.0})] + [row(temperature=0)] * 7)


def test_top_k_and_top_p_never_sort_the_vocabulary():
    vocab = 4096
    logits = torch.randn(4, vocab, generator=gen(5))
    logits[:, :10] += 12  # a peaked, LLM-like head
    rows = [row(top_k=40, top_p=0.9), row(top_p=0.9), row(top_k=5), row(top_p=0.95, temperature=0.7)]
    with torch.profiler.profile(record_shapes=True) as prof:
        Sampler()(logits, rows)
    sorts = [e.input_shapes[0] for e in prof.events() if e.name == "aten::sort" and e.input_shapes]
    assert all(shape[-1] < vocab // 4 for shape in sorts), sorts


def test_window_grows_for_flat_rows_and_boundary_ties():
    flat = torch.zeros(2, 2048)
    flat[1, :100] = 1.0  # 100-way tie at the top, top-k 5 must keep all of them
    vals, ids = truncation_window(flat, t1(0, 5), t1(1.0, 1.0), t1(0.95, 1.0), min_width=16)
    kept0 = set(ids[0][torch.isfinite(vals[0])].tolist())
    kept1 = set(ids[1][torch.isfinite(vals[1])].tolist())
    assert len(kept0) == 2048 and kept1 == set(range(100))


def test_empty_batch():
    out = Sampler()(torch.zeros(0, 10), [])
    assert out.token_ids.shape == (0,) and out.token_ids.dtype == torch.int64 and out.top_logprobs is None


def test_input_logits_untouched():
    logits = torch.randn(3, 30)
    before = logits.clone()
    rows = [row(logit_bias={1: 3.0}, banned_token_ids=[2]), row(repetition_penalty=2.0, prompt=[0, 1]), row(top_k=3)]
    Sampler()(logits, rows)
    assert torch.equal(logits, before)


# ------------------------------------------------------------ property tests


def ref_support(z: np.ndarray, f: str, x: float) -> tuple[set[int], float]:
    """(support, distance of the decision to its boundary) in float64 for one filter."""
    probs = np.exp(z - z.max())
    probs /= probs.sum()
    if f == "top_k":
        thr = np.sort(z)[::-1][int(x) - 1]
        return set(np.nonzero(z >= thr)[0].tolist()), 1.0
    if f == "min_p":
        ratio = probs / probs.max()
        return set(np.nonzero(ratio >= x)[0].tolist()), float(np.min(np.abs(ratio - x)))
    key = -z if f == "top_p" else np.abs(np.log(probs) + (-(probs * np.log(probs)).sum()))
    order = np.argsort(key, kind="stable")
    excl = np.concatenate([[0.0], np.cumsum(probs[order])[:-1]])
    n = max(1, int((excl < x).sum()))
    kept = set(np.nonzero(key <= key[order[n - 1]])[0].tolist())
    gaps = np.diff(np.sort(key))
    near_tie = float(gaps[gaps > 0].min()) if (gaps > 0).any() else 1.0
    return kept, min(float(np.min(np.abs(excl - x))), near_tie)


@PROPERTY
@given(
    z=st.lists(st.floats(-8, 8, width=32), min_size=2, max_size=10),
    f=st.sampled_from(["top_k", "top_p", "min_p", "typical_p"]),
    x=st.floats(0.01, 0.99),
)
def test_filters_match_float64_reference(z, f, x):
    arr = np.array(z, dtype=np.float32).astype(np.float64)
    param = float(max(1, round(x * len(z)))) if f == "top_k" else x
    expected, margin = ref_support(arr, f, param)
    assume(margin > 1e-4)
    fn = {"top_k": apply_top_k, "top_p": apply_top_p, "min_p": apply_min_p, "typical_p": apply_typical_p}[f]
    arg = torch.tensor([int(param)]) if f == "top_k" else torch.tensor([param])
    assert support(fn(torch.tensor([z], dtype=torch.float32), arg)) == expected


@st.composite
def batches(draw):
    vocab = draw(st.integers(2, 12))
    n = draw(st.integers(1, 4))
    logit = st.one_of(st.floats(-30, 30, width=32), st.just(-math.inf))
    logits = [draw(st.lists(logit, min_size=vocab, max_size=vocab)) for _ in range(n)]
    assume(all(any(math.isfinite(v) for v in r) for r in logits))
    tok = st.integers(0, vocab - 1)
    rows = []
    for _ in range(n):
        params = SamplingParams(
            temperature=draw(st.one_of(st.just(0.0), st.floats(0.05, 4.0))),
            top_k=draw(st.integers(-1, vocab + 1)),
            top_p=draw(st.one_of(st.just(1.0), st.floats(0.01, 1.0))),
            min_p=draw(st.one_of(st.just(0.0), st.floats(0.0, 1.0))),
            typical_p=draw(st.one_of(st.just(1.0), st.floats(0.01, 1.0))),
            repetition_penalty=draw(st.one_of(st.just(1.0), st.floats(0.5, 2.0))),
            frequency_penalty=draw(st.one_of(st.just(0.0), st.floats(-2.0, 2.0))),
            presence_penalty=draw(st.one_of(st.just(0.0), st.floats(-2.0, 2.0))),
            logit_bias=draw(st.one_of(st.none(), st.dictionaries(tok, st.floats(-100, 100), max_size=3))),
            allowed_token_ids=draw(st.one_of(st.none(), st.lists(tok, min_size=1, max_size=4))),
            banned_token_ids=draw(st.one_of(st.none(), st.lists(tok, max_size=3))),
            logprobs=draw(st.one_of(st.none(), st.integers(0, 4))),
        )
        seed = draw(st.one_of(st.none(), st.integers(0, 2**31)))
        rows.append(
            SamplingRow(
                params,
                draw(st.lists(tok, max_size=5)),
                draw(st.lists(tok, max_size=5)),
                None if seed is None else gen(seed),
                draw(st.lists(tok, max_size=2)),
            )
        )
    return torch.tensor(logits, dtype=torch.float32), rows


@PROPERTY
@given(batch=batches())
def test_sampled_token_lies_in_stepwise_support(batch):
    logits, rows = batch
    out = Sampler()(logits, rows)
    n, vocab = logits.shape
    assert isinstance(out, SamplerOutput)
    assert out.token_ids.shape == (n,) and out.token_ids.dtype == torch.int64
    assert out.logprobs.shape == (n,) and out.logprobs.dtype == torch.float32
    k = max((r.params.logprobs or 0) for r in rows)
    if k == 0:
        assert out.top_logprob_ids is None and out.top_logprobs is None
    else:
        assert out.top_logprob_ids.shape == (n, min(k, vocab)) and out.top_logprobs.dtype == torch.float32
    z = process_logits(logits, rows)
    for i, r in enumerate(rows):
        tok = out.token_ids[i].item()
        assert math.isfinite(z[i, tok].item())  # never a -inf token
        p = r.params
        if p.greedy:
            assert tok == z[i].argmax().item()
            continue
        zi = apply_temperature(z[i : i + 1], t1(p.temperature))
        zi = apply_top_k(zi, t1(p.top_k))
        zi = apply_top_p(zi, t1(p.top_p))
        zi = apply_min_p(zi, t1(p.min_p))
        zi = apply_typical_p(zi, t1(p.typical_p))
        assert tok in support(zi)


@PROPERTY
@given(
    data=st.data(),
    n=st.integers(1, 4),
    vocab=st.integers(2, 40),
    min_width=st.integers(1, 8),
)
def test_truncation_window_matches_stepwise_filters(data, n, vocab, min_width):
    logits = torch.tensor(
        data.draw(st.lists(st.lists(st.floats(-6, 6, width=32), min_size=vocab, max_size=vocab), min_size=n, max_size=n))
    )
    k = torch.tensor(data.draw(st.lists(st.integers(0, vocab), min_size=n, max_size=n)))
    temp = torch.tensor(data.draw(st.lists(st.floats(0.1, 3.0), min_size=n, max_size=n)))
    p = torch.tensor(data.draw(st.lists(st.floats(0.05, 0.99), min_size=n, max_size=n)))
    vals, ids = truncation_window(logits, k, temp, p, min_width=min_width)
    expected = apply_top_p(apply_top_k(apply_temperature(logits, temp), k), p)
    for i in range(n):
        finite = torch.isfinite(vals[i])
        assert set(ids[i][finite].tolist()) == support(expected[i])
        assert torch.equal(vals[i][finite], expected[i][ids[i][finite]])
