"""Batched sampler: raw logits [B, V] -> one token per row, plus raw-distribution logprobs.

Per-row pipeline, all fp32 (the order is part of the API):

1. hard constraints: + logit_bias; outside ``allowed_token_ids`` -> -inf;
   ``banned_token_ids`` and the engine's ``suppress_token_ids`` -> -inf; tokens the row's grammar
   rejects (``grammar_bitmask``, structured output) -> -inf
2. penalties: repetition (prompt + output, sign-aware), then frequency / presence (output)
3. temperature; T == 0 is greedy: argmax of the logits after steps 1-2 (lowest id on ties)
4. top-k -> top-p -> min-p -> typical-p, each on the previous stage's renormalised support
   (rows with top-k or top-p work on a small top-k window instead of sorting all of V)
5. one draw by inverse CDF over the kept support in token-id order, with one uniform per
   row from the row's own generator when it has one

Logprobs are taken from the raw logits (before steps 1-5), like vLLM's default.
If a row's hard constraints leave no finite logit, that row falls back to its raw logits
for this step rather than emitting garbage; a row with a grammar falls back to its raw logits
under the grammar alone, so it never emits a token the grammar rejects.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from baton_serve.kernels import backend
from baton_serve.workers.sampling.ops import (
    NEG_INF,
    apply_min_p,
    apply_temperature,
    apply_typical_p,
    exp_weights_,
    inverse_cdf_sample,
    min_p_removed,
    penalize_,
    token_mask,
    truncation_window,
)
from baton_serve.workers.sampling.params import SamplingParams
from baton_serve.workers.sampling.structured.mask import apply_bitmask_

_CPU_CHUNK_ROWS = 32


@dataclass
class SamplingRow:
    """One batch row: its parameters, token history and (optional) seeded generator."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    generator: torch.Generator | None
    suppress_token_ids: Sequence[int] = ()
    grammar_bitmask: torch.Tensor | None = None  # int32 words, bit t set = token t allowed


@dataclass
class SamplerOutput:
    """Sampled ids [B] and raw logprobs; top-k columns beyond a row's own k are padding."""

    token_ids: torch.Tensor
    logprobs: torch.Tensor  # NaN in rows of a chunk where no row asked for logprobs
    top_logprob_ids: torch.Tensor | None
    top_logprobs: torch.Tensor | None


def _needs_hard(row: SamplingRow) -> bool:
    p = row.params
    return bool(p.logit_bias or p.allowed_token_ids is not None or p.banned_token_ids or row.suppress_token_ids
                or row.grammar_bitmask is not None)


def _needs_penalty(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0


def _uses_window(p: SamplingParams, vocab: int) -> bool:
    return 0 < p.top_k < vocab or p.top_p < 1.0


def _take(z: torch.Tensor, idx: list[int]) -> torch.Tensor:
    # All-rows selections skip the gather copy: the common case is a homogeneous batch.
    return z if len(idx) == z.shape[0] else z[torch.tensor(idx, device=z.device)]


def _put(z: torch.Tensor, idx: list[int], value: torch.Tensor) -> torch.Tensor:
    if len(idx) == z.shape[0]:
        return value
    z[torch.tensor(idx, device=z.device)] = value
    return z


def _row_chunks(n: int, device: torch.device) -> list[slice]:
    # On CPU, full-vocab temporaries for a few rows at a time stay cache-resident and
    # reuse allocator blocks (one [256, 49152] temporary is a page-faulting 50 MB
    # allocation); an accelerator wants a single launch over the whole batch.
    step = _CPU_CHUNK_ROWS if device.type == "cpu" else max(n, 1)
    return [slice(i, i + step) for i in range(0, n, step)]


def _param(rows: Sequence[SamplingRow], name: str, device: torch.device) -> torch.Tensor:
    return torch.tensor([float(getattr(r.params, name)) for r in rows], dtype=torch.float32, device=device)


def process_logits(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Steps 1-2 (hard constraints, penalties) as new fp32 logits; ``logits`` is untouched."""
    x = logits.float()
    return _process(x, rows, x.clone(memory_format=torch.contiguous_format))


def _process(x: torch.Tensor, rows: Sequence[SamplingRow], z: torch.Tensor) -> torch.Tensor:
    """Steps 1-2 written into ``z``, a contiguous private copy of the fp32 raw logits ``x``."""
    hard = [i for i, r in enumerate(rows) if _needs_hard(r)]
    if hard:
        _constrain_(z, x, rows, hard)
    pen = [i for i, r in enumerate(rows) if _needs_penalty(r.params)]
    if pen:
        sub = [rows[i] for i in pen]
        # Rows without a repetition penalty skip converting their (possibly long) prompt.
        prompts = [r.prompt_token_ids if r.params.repetition_penalty != 1.0 else () for r in sub]
        dev = z.device
        new = penalize_(
            _take(z, pen),
            prompts,
            [r.output_token_ids for r in sub],
            _param(sub, "repetition_penalty", dev),
            _param(sub, "frequency_penalty", dev),
            _param(sub, "presence_penalty", dev),
        )
        z = _put(z, pen, new)
    return z


def _constrain_(z: torch.Tensor, x: torch.Tensor, rows: Sequence[SamplingRow], idx: list[int]) -> None:
    """Step 1 in place on ``z`` for rows ``idx``: bias, allowed set, banned + suppressed ids."""
    bias_r: list[int] = []
    bias_t: list[int] = []
    bias_v: list[float] = []
    ban_r: list[int] = []
    ban_t: list[int] = []
    allowed: list[int] = []
    for i in idx:
        p = rows[i].params
        for tok, b in (p.logit_bias or {}).items():
            bias_r.append(i)
            bias_t.append(int(tok))
            bias_v.append(float(b))
        if p.allowed_token_ids is not None:
            allowed.append(i)
        dropped = [*(p.banned_token_ids or ()), *rows[i].suppress_token_ids]
        ban_r.extend([i] * len(dropped))
        ban_t.extend(int(t) for t in dropped)
    dev = z.device
    if bias_r:
        where = (torch.tensor(bias_r, device=dev), torch.tensor(bias_t, device=dev))
        z.index_put_(where, torch.tensor(bias_v, dtype=z.dtype, device=dev), accumulate=True)
    if allowed:
        keep = token_mask([rows[i].params.allowed_token_ids or () for i in allowed], z.shape[-1], dev)
        a = torch.tensor(allowed, device=dev)
        z[a] = z[a].masked_fill(~keep, NEG_INF)
    if ban_r:
        z[torch.tensor(ban_r, device=dev), torch.tensor(ban_t, device=dev)] = NEG_INF
    grammar = [i for i in idx if rows[i].grammar_bitmask is not None]
    if grammar:
        apply_bitmask_(z, torch.stack([rows[i].grammar_bitmask for i in grammar]), grammar)
    masked = torch.tensor(idx, device=dev)
    dead = masked[~(z[masked] > NEG_INF).any(-1)].tolist()
    if dead:
        z[dead] = x[dead]
        # The grammar is the one constraint that is never dropped: bias and bans are.
        kept = [i for i in dead if rows[i].grammar_bitmask is not None]
        if kept:
            apply_bitmask_(z, torch.stack([rows[i].grammar_bitmask for i in kept]), kept)


class Sampler:
    """Stateless batched sampler; see the module docstring for the pipeline."""

    def __call__(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> SamplerOutput:
        """logits [B, V] (any float dtype; work in fp32). Pure except advancing generators."""
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits must be [len(rows), V], got {tuple(logits.shape)} for {len(rows)} rows")
        x = logits.float()
        if not rows:
            return SamplerOutput(torch.zeros(0, dtype=torch.int64, device=x.device), x.new_zeros(0), None, None)
        k = min(max((r.params.logprobs or 0) for r in rows), x.shape[-1])
        # Every stage is row-independent, so run the whole pipeline chunk by chunk.
        parts = [self._chunk(x[sl], rows[sl], k) for sl in _row_chunks(len(rows), x.device)]
        tokens = torch.cat([p.token_ids for p in parts])
        chosen = torch.cat([p.logprobs for p in parts])
        if k <= 0:
            return SamplerOutput(tokens, chosen, None, None)
        top_ids = torch.cat([p.top_logprob_ids for p in parts if p.top_logprob_ids is not None])
        top_vals = torch.cat([p.top_logprobs for p in parts if p.top_logprobs is not None])
        return SamplerOutput(tokens, chosen, top_ids, top_vals)

    def _chunk(self, x: torch.Tensor, rows: Sequence[SamplingRow], k: int) -> SamplerOutput:
        """The full pipeline for a few rows; top-k raw logprobs only when k > 0."""
        plain = not any(_needs_hard(r) or _needs_penalty(r.params) for r in rows)
        greedy = [i for i, r in enumerate(rows) if r.params.greedy]
        if plain and len(greedy) == len(rows):
            tokens = backend.argmax_rows(x)  # fast path: nothing to process, nothing to draw
        else:
            # x may alias the caller's tensor: steps 1-2 write into a private copy only.
            z = x if plain else _process(x, rows, x.clone(memory_format=torch.contiguous_format))
            tokens = torch.empty(len(rows), dtype=torch.int64, device=x.device)
            if greedy:
                tokens[torch.tensor(greedy, device=x.device)] = backend.argmax_rows(_take(z, greedy))
            sampled = [i for i, r in enumerate(rows) if not r.params.greedy]
            if sampled:
                picked = self._sample(_take(z, sampled), [rows[i] for i in sampled])
                tokens[torch.tensor(sampled, device=x.device)] = picked
        if not any(r.params.logprobs is not None for r in rows):
            # Nobody asked: skip the full-vocabulary pass (it costs as much as the argmax path).
            return SamplerOutput(tokens, x.new_full((len(rows),), float("nan")), None, None)
        # Gathering from log_softmax (not x - logsumexp) matches log_softmax exactly and is
        # the cheaper fused pass on CPU.
        logp = x.log_softmax(-1)
        chosen = logp.gather(1, tokens.reshape(-1, 1)).squeeze(1)
        if k <= 0:
            return SamplerOutput(tokens, chosen, None, None)
        top_vals, top_ids = logp.topk(k, dim=-1)
        return SamplerOutput(tokens, chosen, top_ids, top_vals)

    def _sample(self, z: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """Steps 3-5 for non-greedy rows: returns one token id per row."""
        vocab, dev = z.shape[-1], z.device
        u = self._uniforms(rows, dev)
        out = torch.empty(len(rows), dtype=torch.int64, device=dev)
        windowed = [i for i, r in enumerate(rows) if _uses_window(r.params, vocab)]
        full = [i for i, r in enumerate(rows) if not _uses_window(r.params, vocab)]
        for group, fn in ((windowed, self._sample_window), (full, self._sample_full)):
            if group:
                g = torch.tensor(group, device=dev)
                out[g] = fn(_take(z, group), [rows[i] for i in group], u[g])
        return out

    @staticmethod
    def _uniforms(rows: Sequence[SamplingRow], device: torch.device) -> torch.Tensor:
        """One U[0,1) per row: from the row's generator if seeded, else from the default generator."""
        u = torch.empty(len(rows), dtype=torch.float64, device=device)
        seeded = [i for i, r in enumerate(rows) if r.generator is not None]
        unseeded = [i for i, r in enumerate(rows) if r.generator is None]
        if unseeded:
            u[torch.tensor(unseeded, device=device)] = torch.rand(len(unseeded), dtype=u.dtype, device=device)
        if seeded:
            # A generator draws on its own device, which may differ from the logits'.
            draws = []
            for i in seeded:
                gen = rows[i].generator
                assert gen is not None
                draws.append(torch.rand(1, dtype=torch.float64, generator=gen, device=gen.device).to(device))
            u[torch.tensor(seeded, device=device)] = torch.cat(draws)
        return u

    @staticmethod
    def _sample_window(z: torch.Tensor, rows: Sequence[SamplingRow], u: torch.Tensor) -> torch.Tensor:
        """Rows with top-k or top-p: later stages and the draw run on a small top-k window."""
        dev = z.device
        k = torch.tensor([r.params.top_k for r in rows], dtype=torch.int64, device=dev)
        vals, ids = truncation_window(z, k, _param(rows, "temperature", dev), _param(rows, "top_p", dev))
        vals = Sampler._tail_filters(vals, rows)
        order = ids.argsort(-1)  # canonical token-id order for the inverse CDF
        col = inverse_cdf_sample(vals.gather(1, order).softmax(-1), u)
        return ids.gather(1, order).gather(1, col.reshape(-1, 1)).squeeze(1)

    @staticmethod
    def _sample_full(z: torch.Tensor, rows: Sequence[SamplingRow], u: torch.Tensor) -> torch.Tensor:
        """Rows with neither top-k nor top-p: the remaining filters run over the whole vocabulary."""
        vals = apply_temperature(z, _param(rows, "temperature", z.device))
        if any(r.params.typical_p < 1.0 for r in rows):
            vals = Sampler._tail_filters(vals, rows)
        elif any(r.params.min_p > 0.0 for r in rows):
            vals.masked_fill_(min_p_removed(vals, _param(rows, "min_p", z.device)), NEG_INF)
        # Unnormalised weights suffice for the inverse CDF; ``vals`` is ours to overwrite.
        return inverse_cdf_sample(exp_weights_(vals), u)

    @staticmethod
    def _tail_filters(vals: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """Min-p then typical-p on temperature-scaled logits, each only where a row enables it."""
        dev = vals.device
        if any(r.params.min_p > 0.0 for r in rows):
            # Elementwise and cheap: rows with min_p == 0 pass through unchanged.
            vals = apply_min_p(vals, _param(rows, "min_p", dev))
        typical = [i for i, r in enumerate(rows) if r.params.typical_p < 1.0]
        if typical:
            sub = [rows[i] for i in typical]
            vals = _put(vals, typical, apply_typical_p(_take(vals, typical), _param(sub, "typical_p", dev)))
        return vals
