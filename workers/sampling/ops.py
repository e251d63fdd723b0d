"""Pure, batched logits processors used by the sampler.

Every ``apply_*`` function takes fp32 logits ``[B, V]`` plus per-row parameters (tensors
``[B]``; token histories for penalties) and returns NEW logits with removed entries set
to ``-inf``; inputs are never modified (only the ``*_`` helpers work in place). Removed
entries vanish from a later softmax, so "renormalise within the kept support" is
implicit between stages.

Ties: a filter that keeps a token also keeps every token whose value ties with it on the
filter's sort key (logit for top-k/top-p, typicality score for typical-p). The support
is then a function of the values alone, never of the order a sort happened to return,
so the sampler's windowed path and these functions agree (up to float rounding of sums
that land exactly on a threshold).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

NEG_INF = float("-inf")
_EXP_FLOOR = -87.0  # exp(-87) ~ 1.6e-38, just above fp32's smallest normal
_WEIGHT_FLOOR = 2e-38


def _col(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Per-row parameter [B] as a [B, 1] column with ``like``'s device and dtype."""
    return t.to(device=like.device, dtype=like.dtype).reshape(-1, 1)


def _exclusive_cumsum(x: torch.Tensor) -> torch.Tensor:
    # Shifted rather than ``cumsum - x`` so the first entry is exactly 0 (always kept).
    c = x.cumsum(-1)
    return torch.cat([torch.zeros_like(c[:, :1]), c[:, :-1]], dim=-1)


def apply_temperature(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """Divide each row by its temperature (must be > 0; greedy rows never get here)."""
    return logits / _col(temperature, logits)


def apply_top_k(logits: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Keep each row's k largest logits (plus ties with the k-th); k <= 0 or k >= V disables."""
    vocab = logits.shape[-1]
    k = k.to(device=logits.device, dtype=torch.int64)
    on = (k > 0) & (k < vocab)
    if not bool(on.any()):
        return logits.clone()
    kk = torch.where(on, k, torch.ones_like(k))
    top = logits.topk(int(kk.max()), dim=-1).values
    thr = top.gather(1, (kk - 1).reshape(-1, 1)).masked_fill(~on.reshape(-1, 1), NEG_INF)
    return logits.masked_fill(logits < thr, NEG_INF)


def _nucleus_threshold(vals: torch.Tensor, probs: torch.Tensor, p_col: torch.Tensor) -> torch.Tensor:
    """[B, 1] value threshold of the nucleus of descending ``vals`` with masses ``probs``."""
    # Token j is in the nucleus iff the mass strictly before it is < p: this keeps the
    # boundary token whose own mass makes the cumulative sum reach p.
    n_keep = (_exclusive_cumsum(probs) < p_col).sum(-1, keepdim=True).clamp_(min=1)
    return vals.gather(1, n_keep - 1).masked_fill(p_col >= 1.0, NEG_INF)


def top_p_sorted(vals: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """``apply_top_p`` for rows already sorted descending."""
    thr = _nucleus_threshold(vals, vals.softmax(-1), _col(p, vals))
    return vals.masked_fill(vals < thr, NEG_INF)


def apply_top_p(logits: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Nucleus filter: keep the smallest descending prefix whose mass reaches >= p; p >= 1 disables."""
    vals, order = logits.sort(dim=-1, descending=True)
    return torch.empty_like(logits).scatter_(1, order, top_p_sorted(vals, p))


def truncation_window(
    logits: torch.Tensor,
    k: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    min_width: int = 256,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Temperature, top-k and top-p for rows that use top-k and/or top-p, without a full sort.

    Returns (vals, ids), each [B, W]: temperature-scaled logits with both filters applied
    (removed -> -inf) and their token ids; every token of a row's support is in its
    window, so later stages and the draw run on W << V columns. Rows without top-k start
    from ``min_width`` columns; a row whose window cuts into its support (or a tie of it)
    is redone 4x wider, up to V. Padding columns are -inf.
    """
    vocab = logits.shape[-1]
    k = k.to(device=logits.device, dtype=torch.int64)
    has_k = ((k > 0) & (k < vocab)).reshape(-1, 1)
    kk = torch.where(has_k.squeeze(1), k, torch.full_like(k, vocab)).reshape(-1, 1)
    temp, p_col = _col(temperature, logits), _col(top_p, logits)
    # Rows without top-k take nucleus masses from the FULL row's normaliser: the window
    # holds only part of their distribution.
    lse = torch.zeros_like(temp)
    all_k = bool(has_k.all())
    if not all_k:
        lse = torch.where(has_k, lse, _logsumexp(logits / temp))
    width = min(vocab, max(1 if all_k else min_width, int(torch.where(has_k, kk, 0).max()) + 1))
    return _grow_window(logits, kk, has_k, temp, p_col, lse, width)


def _logsumexp(x: torch.Tensor) -> torch.Tensor:
    """[B, 1] row logsumexp without the slow fp32-denormal exp path (see ``exp_weights_``)."""
    m = x.amax(-1, keepdim=True)
    # Clamped terms add at most V * 1.6e-38 to a sum >= 1: invisible in fp32.
    return m + (x - m).clamp_(min=_EXP_FLOOR).exp_().sum(-1, keepdim=True).log_()


def _grow_window(
    logits: torch.Tensor,
    kk: torch.Tensor,
    has_k: torch.Tensor,
    temp: torch.Tensor,
    p_col: torch.Tensor,
    lse: torch.Tensor,
    width: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One ``truncation_window`` attempt at ``width`` columns; unfinished rows recurse wider."""
    vocab = logits.shape[-1]
    raw, ids = logits.topk(width, dim=-1)
    scaled = raw / temp  # same order as ``raw`` since T > 0
    kth = scaled.gather(1, kk.clamp(max=width) - 1).masked_fill(~has_k, NEG_INF)
    vals = scaled.masked_fill(scaled < kth, NEG_INF)
    logp = torch.where(has_k, vals.log_softmax(-1), vals - lse)
    p_thr = _nucleus_threshold(vals, logp.exp(), p_col)
    vals = vals.masked_fill(vals < p_thr, NEG_INF)
    # A row's window is complete when its last column falls strictly below the row's
    # support boundary: no kept token, nor a tie of one, can lie beyond it.
    bound = torch.where(has_k, kth, p_thr)
    redo = ~((scaled[:, -1:] < bound) | (bound == NEG_INF)).squeeze(1)
    if width == vocab or not bool(redo.any()):
        return vals, ids
    r = redo.nonzero().squeeze(1)
    sub_vals, sub_ids = _grow_window(logits[r], kk[r], has_k[r], temp[r], p_col[r], lse[r], min(4 * width, vocab))
    pad = sub_vals.shape[-1] - width
    vals = torch.nn.functional.pad(vals, (0, pad), value=NEG_INF)
    ids = torch.nn.functional.pad(ids, (0, pad))
    vals[r], ids[r] = sub_vals, sub_ids
    return vals, ids


def min_p_removed(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Bool [B, V]: tokens ``apply_min_p`` removes."""
    mp = _col(min_p, logits)
    zmax = logits.amax(-1, keepdim=True)
    thr = torch.where(mp > 0, zmax + torch.log(mp.clamp(min=1e-30)), torch.full_like(mp, NEG_INF))
    return logits < thr


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Keep tokens with prob >= min_p * max_prob of this row's softmax; min_p <= 0 disables.

    Compared in log space (z - z_max >= log min_p), which equals the probability test and
    needs no softmax. Pass temperature-scaled logits: the support then depends on T.
    """
    return logits.masked_fill(min_p_removed(logits, min_p), NEG_INF)


def apply_typical_p(logits: torch.Tensor, typical_p: torch.Tensor) -> torch.Tensor:
    """Locally typical filter (Meister et al.): typical_p >= 1 disables.

    Rank tokens by |(-log p) - H| ascending, keep the smallest such prefix whose mass
    reaches >= typical_p (at least one token).
    """
    logp = logits.log_softmax(-1)
    probs = logp.exp()
    entropy = -torch.where(probs > 0, probs * logp, torch.zeros_like(probs)).sum(-1, keepdim=True)
    score = (logp + entropy).abs()  # removed tokens (logp = -inf) score +inf: ranked last
    s_sorted, order = score.sort(dim=-1)
    tau = _col(typical_p, probs)
    n_keep = (_exclusive_cumsum(probs.gather(1, order)) < tau).sum(-1, keepdim=True).clamp_(min=1)
    thr = s_sorted.gather(1, n_keep - 1).masked_fill(tau >= 1.0, float("inf"))
    return logits.masked_fill(score > thr, NEG_INF)


def penalize_(
    logits: torch.Tensor,
    prompt_ids: Sequence[Sequence[int]],
    output_ids: Sequence[Sequence[int]],
    repetition: torch.Tensor,
    frequency: torch.Tensor,
    presence: torch.Tensor,
) -> torch.Tensor:
    """In-place ``apply_penalties`` on a contiguous tensor the caller owns; returns it."""
    vocab = logits.shape[-1]
    flat = logits.view(-1)
    # Only seen tokens change, so work on sparse (row * V + token) keys, never on all of V.
    p_rows, p_toks = _flatten(prompt_ids, logits.device)
    o_rows, o_toks = _flatten(output_ids, logits.device)
    out_keys, counts = (o_rows * vocab + o_toks).unique(return_counts=True)
    seen = torch.cat([p_rows * vocab + p_toks, out_keys]).unique()
    z = flat[seen]
    r = repetition.to(device=logits.device, dtype=logits.dtype)[seen // vocab]
    flat[seen] = torch.where(z > 0, z / r, z * r)
    row = out_keys // vocab
    f = frequency.to(device=logits.device, dtype=logits.dtype)[row]
    pres = presence.to(device=logits.device, dtype=logits.dtype)[row]
    flat[out_keys] -= f * counts.to(logits.dtype) + pres
    return logits


def apply_penalties(
    logits: torch.Tensor,
    prompt_ids: Sequence[Sequence[int]],
    output_ids: Sequence[Sequence[int]],
    repetition: torch.Tensor,
    frequency: torch.Tensor,
    presence: torch.Tensor,
) -> torch.Tensor:
    """Repetition, then frequency / presence penalties; row i uses ``prompt_ids[i]``, ``output_ids[i]``.

    Repetition (sign-aware, r = ``repetition``): each token seen in the prompt OR the
    output gets z > 0 -> z / r, else z * r. Then, over OUTPUT tokens only,
    z -= frequency * count + presence * (count > 0).
    """
    own = logits.clone(memory_format=torch.contiguous_format)
    return penalize_(own, prompt_ids, output_ids, repetition, frequency, presence)


def _flatten(seqs: Sequence[Sequence[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    parts = [torch.as_tensor(s, dtype=torch.int64).reshape(-1) for s in seqs]
    lens = torch.tensor([len(t) for t in parts], dtype=torch.int64)
    flat = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)
    rows = torch.repeat_interleave(torch.arange(len(parts)), lens)
    return rows.to(device), flat.to(device)


def token_mask(seqs: Sequence[Sequence[int]], vocab: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[len(seqs), vocab] bool: whether each token id occurs in each sequence."""
    rows, flat = _flatten(seqs, torch.device(device))
    mask = torch.zeros(len(seqs), vocab, dtype=torch.bool, device=device)
    mask[rows, flat] = True
    return mask


def exp_weights_(logits: torch.Tensor) -> torch.Tensor:
    """In place: unnormalised probabilities exp(z - max) per row; -inf and anything with
    relative weight below ~2e-38 become exactly 0."""
    # An exp landing in fp32's denormal range is a very slow CPU path (low temperatures
    # put most of V there): clamp so every exp stays normal, then zero the clamped tail.
    logits.sub_(logits.amax(-1, keepdim=True)).clamp_(min=_EXP_FLOOR).exp_()
    return torch.nn.functional.threshold_(logits, _WEIGHT_FLOOR, 0.0)


def _search(weights: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse CDF in column order: ([B, 1] index, [B, 1] fresh uniform within that column)."""
    cdf = weights.double().cumsum(-1)
    target = u * cdf[:, -1:]
    idx = torch.searchsorted(cdf, target, right=True).clamp_(max=weights.shape[-1] - 1)
    w = weights.gather(1, idx)
    if bool((w <= 0).any()):
        # Only reachable when rounding puts the target at the very top of the cdf.
        cols = torch.arange(weights.shape[-1], device=weights.device).expand_as(weights)
        last = torch.where(weights > 0, cols, torch.full_like(cols, -1)).amax(-1, keepdim=True)
        idx = torch.where(w > 0, idx, last)
        w = weights.gather(1, idx)
    before = cdf.gather(1, idx) - w.double()
    inner = ((target - before) / w.double()).clamp_(0.0, 1.0 - 2.0**-53)
    return idx, inner


def inverse_cdf_sample(probs: torch.Tensor, u: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """Column index per row drawn from ``probs`` [B, W] (unnormalised ok) with uniforms ``u`` [B].

    One uniform per row means a seeded generator advances by exactly one draw per step
    whatever the row's width, so a row's tokens never depend on its batch neighbours.
    Zero-probability columns are never returned. Wide rows pick a block of ``block``
    columns by its mass, then a column inside it, re-using the uniform's remainder: the
    same draw as one flat inverse CDF, without an fp64 cumsum over all of V.
    """
    n, width = probs.shape
    u = u.to(device=probs.device, dtype=torch.float64).reshape(-1, 1)
    if width <= 2 * block:
        return _search(probs, u)[0].squeeze(1)
    n_blocks = -(-width // block)
    pad = n_blocks * block - width
    blocks = (torch.nn.functional.pad(probs, (0, pad)) if pad else probs.contiguous()).view(n, n_blocks, block)
    b, inner = _search(blocks.sum(-1), u)
    local = blocks[torch.arange(n, device=probs.device), b.squeeze(1)]
    return (b * block + _search(local, inner)[0]).squeeze(1)
