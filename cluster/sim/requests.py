"""The simulated workload: the same request shapes, warm-ups and arrival schedule ``baton bench``
sends (``cluster.bench``), as token ids. Ids are synthetic (the forward pass is not run), but
requests of one prefix group share exactly its prefix's ids, so prefix caching sees what it sees
live; every other id is fresh."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from baton_serve.cluster.bench.runner import BenchConfig, schedule
from baton_serve.cluster.bench.workload import RequestSpec, WorkloadError

_FIRST_ID = 16  # below: special tokens (BOS, EOS, pad) are never drawn
_VOCAB = 32000


@dataclass
class SimRequest:
    """One request to simulate: its prompt, exact output length, and arrival (None: a closed-loop
    user sends it when free)."""

    index: int
    prompt_token_ids: list[int]
    output_len: int
    arrival_s: float | None
    warmup: bool = False


@dataclass
class SimWorkload:
    """Warm-ups (sent one at a time first, as ``baton bench`` does) and the measured requests."""

    warmups: list[SimRequest]
    requests: list[SimRequest]
    mode: str
    users: int | None = None  # closed loop: this many users, each sending its next when one ends


def _ids(rng: np.random.Generator, n: int) -> list[int]:
    return rng.integers(_FIRST_ID, _VOCAB, size=max(n, 0)).tolist()


def _prompt(spec: RequestSpec, rng: np.random.Generator, prefixes: dict[int, list[int]]) -> list[int]:
    if spec.text is not None and not spec.prompt_len:
        length = max(len(spec.text.split()), 1)  # no tokenizer here: about a token a word
    else:
        length = spec.prompt_len
    head: list[int] = []
    if spec.prefix_group >= 0:
        if spec.prefix_group not in prefixes:
            prefixes[spec.prefix_group] = _ids(rng, spec.prefix_len)
        head = prefixes[spec.prefix_group]
    return head + _ids(rng, length - len(head))


def build_workload(cfg: BenchConfig) -> SimWorkload:
    """The requests ``cfg`` makes ``baton bench`` send, with the same lengths, prefix groups, warm-ups
    and schedule. Raises WorkloadError as the bench does."""
    specs = cfg.workload.build(cfg.num_prompts, cfg.seed)
    warm = cfg.workload.warmups(cfg.num_warmups, cfg.seed)
    rng = np.random.default_rng(cfg.seed)
    prefixes: dict[int, list[int]] = {}
    prompts = [_prompt(s, rng, prefixes) for s in specs]
    warmups = [SimRequest(-1 - i, _prompt(s, rng, {}), s.output_len, None, True) for i, s in enumerate(warm)]
    if cfg.warmup_prefixes:
        if not any(s.prefix_group >= 0 for s in specs):
            raise WorkloadError("warm-up of prefixes needs a workload with shared prefixes (shared-prefix)")
        seen: set[int] = set()
        for spec, prompt in zip(specs, prompts):
            if spec.prefix_group >= 0 and spec.prefix_group not in seen:
                seen.add(spec.prefix_group)
                tail = _ids(rng, len(prompt) - spec.prefix_len)
                warmups.append(SimRequest(-1 - len(warmups), prompt[:spec.prefix_len] + tail, spec.output_len,
                                          None, True))
    offsets, mode = schedule(cfg, specs)
    requests = [SimRequest(i, p, s.output_len, None if offsets is None else offsets[i])
                for i, (s, p) in enumerate(zip(specs, prompts))]
    return SimWorkload(warmups, requests, mode, None if offsets is not None else (cfg.max_concurrency or 1))
