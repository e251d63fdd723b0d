"""Completion-time estimates for a request on a (prefill, decode) pair, from measured rates.

time to first token = queue wait (pending prefill tokens ahead) + the prompt's uncached part, at
                      the worker's measured prefill cost + on a worker that decodes too, what its
                      running sequences add to the steps until then (``decoding_s``)
KV shipment         = per-shipment overhead + blocks the decode worker lacks x bytes per block, at
                      the prefill worker's measured link cost
decoding            = output tokens x the decode worker's step time with one more sequence running

Workers of one role on the same hardware (device, threads, dtype, model) share one fit of all
their intervals (or steps): the prompts one computed whole tell the per-token cost that another's
tails, all about as long, cannot. A worker that has not done the work yet borrows the mean fit of
those that have; before any has, a prior stands in (the first requests of a deployment only).
``stall_weight`` prices the delay a prefill on a busy worker inflicts on the sequences decoding
there: a decode worker prefilling locally, or a colocated worker, pays the time the prompt's tokens
add to its steps (their per-token part: the steps happen for its running sequences anyway) once
per sequence, times the weight.
``work_weight`` prices the delay a prefill inflicts on the requests that will queue behind it: a
request's own TTFT alone would send a prompt to an idle worker that must compute it all rather
than to a holder of its prefix that is busy for about as long, and the cold copy costs every later
arrival there. Each uncached token's compute counts once more, times the weight. So does the time
its tokens add to the step it shares with prompts already waiting there, once per such request
(``joined``): a long prompt sent where short tails queue holds each of them for its whole step.
``evict_weight`` prices the cached prefixes a request pushes out of a full cache: the blocks it
needs beyond the worker's empty room evict cached ones, each worth its prefill again should its
prefix come back. Among workers that hold nothing of a prompt, that sends a new prefix where it
displaces least, so prefixes spread over the caches instead of crowding one by chance.

Workers that take turns at one board's cores (``workers.actor.core_share``: several workers on a
machine with fewer cores than their threads) are not independent hardware: a step waits while the
board's other busy workers hold the cores. Their estimates stretch by the threads stepping on the
board over its cores (``share_factor``), and the core time a request adds there (``stepping_s``:
the per-token part, a prompt's step whole on an idle worker, a decode step's overhead shared by
the batch it joins) is taken from the
mates' requests wherever the board's workers want more cores than it has (``board_s``), both
times ``share_weight`` (0 turns both off). A mate decoding counts as stepping for as long as its
running sequences have tokens left to produce (the front's count), not for the whole prompt: two
16-token sequences near their end do not stretch a 1k-token prefill beside them by half. Work is
work on a full board: a cold copy of a prefix costs every request stepping there, whichever worker
computes it, and a decode batch one worker already steps grows for less than a second worker's
steps would take. On hardware of a worker's
own (a GPU, reserved cores) both are neutral.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from baton_serve.router.routing.base import RouteRequest
from baton_serve.router.routing.rates import LinearCost, StepFit

# Priors until a worker reports (SmolLM2-135M fp32 on 2 Zen 3 cores, order of magnitude).
PRIOR_PREFILL = (0.005, 1 / 2000)  # seconds per step, per prompt token
PRIOR_DECODE = (0.02, 0.002)  # seconds per step, per running sequence
PRIOR_SHIP = (0.005, 1 / 1e9)  # seconds per shipment, per byte
UNFIT_BLOCKS_PENALTY_S = 60.0  # a decode worker without room for the request queues it: price it out


@dataclass(frozen=True)
class _Fit:
    fixed: float
    per_unit: float


def _fit(worker: Any, pool: Iterable[Any], prior: tuple[float, float],
         fit_of: Callable[[Any], tuple[float, float] | None]) -> _Fit:
    own = fit_of(worker)
    if own is not None:
        return _Fit(*own)
    fitted = [f for f in (fit_of(w) for w in pool) if f is not None]
    if fitted:
        return _Fit(sum(f[0] for f in fitted) / len(fitted), sum(f[1] for f in fitted) / len(fitted))
    return _Fit(*prior)


class CostModel:
    """Estimates in seconds; ``pool`` is every worker, for borrowing fits."""

    def __init__(self, stall_weight: float = 1.0, work_weight: float = 1.0, evict_weight: float = 1.0,
                 share_weight: float = 1.0, step_fit: bool = False, pool_fits: bool = True) -> None:
        self.stall_weight = stall_weight
        self.work_weight = work_weight
        self.evict_weight = evict_weight
        self.share_weight = share_weight
        # True: price steps from the fit to the steps themselves where it has a term
        self.step_fit = step_fit
        # True: workers on the same hardware fit together (one fit of all their steps, or of all
        # their intervals): alone, identical idle workers of a tiny model fitted 2-3x apart by
        # noise, and colocated workers fed only prompt tails priced a 1k-token prompt 7x apart
        self.pool_fits = pool_fits
        self._pooled: dict[Any, tuple[tuple[Any, ...], Any]] = {}
        self._memo: dict[tuple[Any, ...], Any] | None = None  # within deciding(): fits by worker

    @contextmanager
    def deciding(self) -> Iterator[CostModel]:
        """One routing decision: each worker's fits are made once in it (loads do not move while
        a policy weighs its candidates; pooled, a fit reads every mate, so per pair it grew with
        the square of the pool)."""
        outer = self._memo is not None
        if not outer:
            self._memo = {}
        try:
            yield self
        finally:
            if not outer:
                self._memo = None

    def _fit(self, worker: Any, attr: str, pool: Iterable[Any], prior: tuple[float, float]) -> _Fit:
        memo = self._memo
        if memo is None:
            return self._make_fit(worker, attr, pool, prior)
        key = ("fit", id(worker), attr, prior)
        fit = memo.get(key)
        if fit is None:
            fit = memo[key] = self._make_fit(worker, attr, pool, prior)
        return fit

    def _make_fit(self, worker: Any, attr: str, pool: Iterable[Any], prior: tuple[float, float]) -> _Fit:
        memo, workers = self._memo, list(pool)
        own = self._own_fit(worker, attr, workers)
        if own is not None:
            return _Fit(*own)
        if memo is None:
            return _fit(worker, workers, prior, lambda w: self._own_fit(w, attr, workers))
        # a worker without a fit of its own borrows the pool's mean: in one decision the pool is
        # one object, so the mean is made once, not once per such worker
        key = ("borrowed", id(pool), attr, prior)
        held = memo.get(key)
        if held is None:  # the memo holds the pool too, so its id is not reused within the decision
            held = memo[key] = (pool, _fit(worker, workers, prior, lambda w: self._own_fit(w, attr, workers)))
        return held[1]

    def _own_fit(self, worker: Any, attr: str, pool: list[Any]) -> tuple[float, float] | None:
        """``worker``'s own fit of ``attr`` (pooled with its mates'), None where it has none yet."""
        memo = self._memo
        key = ("own", id(worker), attr)
        if memo is not None and key in memo:
            return memo[key]
        if not self.pool_fits:
            own = worker.load.fit(attr, self.step_fit)
        else:
            own = worker.load.fit(attr, self.step_fit, self.pooled_step(worker, pool) if self.step_fit else None,
                                  self.pooled_intervals(worker, attr, pool))
        if memo is not None:
            memo[key] = own
        return own

    def pooled_step(self, worker: Any, pool: Iterable[Any]) -> StepFit:
        """The step fit to the steps of every worker in ``pool`` on ``worker``'s hardware (the same
        device, threads, dtype and model): its own where it names none or has no such mates."""
        mates = _mates(worker, pool, lambda w: w.load.hardware)
        if len(mates) == 1:
            return worker.load.step
        steps = [w.load.step for w in mates]
        return self._pool(worker.load.hardware, mates, steps, lambda sums: StepFit.of_sums(sums))

    def pooled_intervals(self, worker: Any, attr: str, pool: Iterable[Any]) -> LinearCost:
        """The interval fit of ``attr`` to the intervals of every worker in ``pool`` with
        ``worker``'s hardware and role: its own where it names no hardware or has no such mates.

        One role only: a prefill worker's prefill intervals are prompts alone, a decode worker's
        are prompt tails inside decode steps, whose time the engine splits by token share. Pooled,
        the prompts one worker computed whole tell its mates' fits the per-token cost that their
        tails alone (all about as long) cannot.
        """
        own: LinearCost = getattr(worker.load, attr)
        if not _measured(own):
            return own
        # in one decision every measured mate gets the same pooled fit: make it once
        slot = (worker.load.hardware, worker.role, attr)
        memo, key = self._memo, ("pooled", *slot, own.fallback)
        if memo is not None and key in memo:
            return memo[key]
        # only fits made of intervals: one set by hand (a test's, an operator's) has no sums to pool
        mates = [w for w in _mates(worker, pool, lambda w: (w.load.hardware, w.role))
                 if _measured(getattr(w.load, attr))]
        if len(mates) == 1:
            return own
        costs: list[LinearCost] = [getattr(w.load, attr) for w in mates]
        fit = self._pool(slot, mates, costs, lambda sums: LinearCost.of_sums(sums, own.fallback))
        if memo is not None:
            memo[key] = fit
        return fit

    def _pool(self, slot: Any, mates: list[Any], fits: list[Any], solve: Callable[[list[float]], Any]) -> Any:
        """The fit ``solve`` makes of the mates' summed ``fits``, cached in ``slot`` until one of
        them moves (a new fit object, or new sums: its ``version``)."""
        key = tuple((w.worker_id, id(f), f.version) for w, f in zip(mates, fits))
        cached = self._pooled.get(slot)
        if cached is not None and cached[0] == key:
            return cached[1]
        fit = solve([sum(col) for col in zip(*(f.sums for f in fits))])
        self._pooled[slot] = (key, fit)
        return fit

    def prefill_s(self, worker: Any, tokens: int, pool: Iterable[Any]) -> float:
        f = self._fit(worker, "prefill", pool, PRIOR_PREFILL)
        return f.fixed + f.per_unit * tokens

    def queue_s(self, worker: Any, pool: Iterable[Any]) -> float:
        # Per token only: queued prompts share steps with the new one (continuous batching), so
        # the per-step overhead is paid once, in ``prefill_s``.
        f = self._fit(worker, "prefill", pool, PRIOR_PREFILL)
        return f.per_unit * max(worker.load.pending_prefill, 0)

    def ttft_s(self, worker: Any, request: RouteRequest, matched_blocks: int, pool: list[Any]) -> float:
        tokens = request.uncached(matched_blocks)
        stepping = (self.queue_s(worker, pool) + self.prefill_s(worker, tokens, pool)
                    + self.decoding_s(worker, tokens, pool))
        return stepping * self.share_factor(worker, stepping, pool)

    def decoding_s(self, worker: Any, tokens: int, pool: Iterable[Any]) -> float:
        """What the sequences decoding on ``worker`` add to a prompt's time to first token there.

        Every step until the prompt's last chunk also computes one token of each of them (the
        queue's and the prompt's tokens over the step's token budget: that many steps), and on a
        worker stepping only decodes now, a new prompt first waits for the step in flight (half
        of one, on average). 0 on a prefill worker: what it runs until shipped decodes nowhere.
        """
        load = worker.load
        running = load.running if worker.role != "prefill" else 0
        if running <= 0:
            return 0.0
        df = self._fit(worker, "decode", pool, PRIOR_DECODE)
        # a one-term decode fit (all its time per step) leaves a sequence's part to the prompt
        # tokens' rate: the engine splits a mixed step's time by token share
        per_seq = df.per_unit if df.per_unit > 0 else self._fit(worker, "prefill", pool, PRIOR_PREFILL).per_unit
        pending = max(load.pending_prefill, 0)
        steps = math.ceil((pending + tokens) / load.step_token_budget) if load.step_token_budget > 0 else 1
        if load.prefill_chunk > 0:  # a prompt longer than a chunk takes a step a chunk
            steps = max(steps, math.ceil(tokens / load.prefill_chunk))
        in_flight = 0.0 if pending else 0.5 * (df.fixed + df.per_unit * running)
        return steps * per_seq * running + in_flight

    def ship_s(self, prefill: Any, request: RouteRequest, decode_matched: int, pool: list[Any]) -> float:
        blocks = max(request.num_blocks - decode_matched, 0)
        f = self._fit(prefill, "ship", pool, PRIOR_SHIP)
        return f.fixed + f.per_unit * blocks * request.kv_block_bytes

    def itl_s(self, worker: Any, pool: list[Any]) -> float:
        running = worker.load.running + 1
        f = self._fit(worker, "decode", pool, PRIOR_DECODE)
        return f.fixed + f.per_unit * running

    def decode_s(self, worker: Any, tokens: int, pool: list[Any]) -> float:
        """``tokens`` decode steps on ``worker`` with one more sequence running, turns included."""
        stepping = tokens * self.itl_s(worker, pool)
        return stepping * self.share_factor(worker, stepping, pool)

    def room_penalty_s(self, worker: Any, request: RouteRequest, matched_blocks: int) -> float:
        needed = math.ceil((request.prompt_len + request.max_tokens) / request.block_size) - matched_blocks
        if worker.load.num_blocks and worker.load.num_free_blocks < needed:
            return UNFIT_BLOCKS_PENALTY_S
        return 0.0

    def work_s(self, worker: Any, request: RouteRequest, matched_blocks: int, pool: list[Any]) -> float:
        """What prefilling the uncached part here costs other requests: those that arrive after it
        (its compute once more), and those queued there whose step it joins (``joined``)."""
        if self.work_weight == 0:
            return 0.0
        f = self._fit(worker, "prefill", pool, PRIOR_PREFILL)
        tokens = request.uncached(matched_blocks)
        queued, added = self.joined(worker, tokens)
        return self.work_weight * f.per_unit * (tokens + queued * added)

    @staticmethod
    def joined(worker: Any, tokens: int) -> tuple[float, int]:
        """(the requests queued on ``worker`` whose step a prompt of ``tokens`` uncached tokens
        joins, the tokens it adds to that step).

        A step takes the waiting prompts first come first served up to its token budget, so a new
        prompt shares the step of the queue's last ``pending % budget`` tokens, and each of their
        requests gets its first token only when the step ends: a 1k-token prompt sent where five
        32-token tails wait makes all six take its time (its first chunk's, where the worker caps
        a prompt's tokens in a step: ``prefill_chunk``). Where the queue's tokens fill whole steps
        it starts one of its own. The requests are counted in proportion to the tokens (those of a
        step in flight, which it does not delay, are not told apart).
        """
        load = worker.load
        pending, waiting = max(load.pending_prefill, 0), max(load.pending_requests, 0)
        if pending == 0 or waiting == 0:
            return 0.0, 0
        budget = load.step_token_budget
        chunk = load.prefill_chunk if load.prefill_chunk > 0 else tokens
        if budget <= 0:  # not reported: one step takes it all
            return float(waiting), min(tokens, chunk)
        ahead = pending % budget
        if ahead == 0:
            return 0.0, 0
        return waiting * ahead / pending, min(tokens, budget - ahead, chunk)

    def stall_s(self, worker: Any, request: RouteRequest, matched_blocks: int, pool: list[Any]) -> float:
        """What prefilling here costs the sequences already decoding on ``worker``."""
        running = worker.load.running
        if running == 0 or self.stall_weight == 0:
            return 0.0
        # the steps run for the sequences anyway: the prompt's tokens are what they add
        return self.stall_weight * running * self.stepping_s(worker, request.uncached(matched_blocks), 0, pool)

    def evict_s(self, worker: Any, request: RouteRequest, matched_blocks: int, cached_blocks: int,
                pool: list[Any]) -> float:
        """What the cached blocks this request would evict on ``worker`` cost to compute again.

        Free blocks are empty or cached-but-unused (evictable); ``cached_blocks`` (what the prefix
        index holds for the worker) bounds the latter, so the empty room is at least the rest.
        """
        load = worker.load
        if self.evict_weight == 0 or not load.num_blocks:
            return 0.0
        needed = math.ceil((request.prompt_len + request.max_tokens) / request.block_size) - matched_blocks
        empty = self.empty_blocks(worker, cached_blocks)
        evicted = min(max(needed - empty, 0), load.num_free_blocks - empty)
        if evicted == 0:
            return 0.0
        f = self._fit(worker, "prefill", pool, PRIOR_PREFILL)
        return self.evict_weight * f.per_unit * evicted * request.block_size

    @staticmethod
    def empty_blocks(worker: Any, cached_blocks: int) -> int:
        """Free blocks that hold no cached prefix: room a new prompt takes without evicting."""
        free = worker.load.num_free_blocks
        return free - min(max(cached_blocks, 0), free)

    # ------------------------------------------------------------------ cores shared on a board
    def busy_s(self, worker: Any, horizon_s: float, pool: list[Any]) -> float:
        """How much of the next ``horizon_s`` seconds ``worker`` steps: its queued prefill, and while
        it decodes, the steps its running sequences have left at most (all of the horizon where
        that is unknown: other fronts send work there too)."""
        load, queued = worker.load, self.queue_s(worker, pool)
        if worker.role == "prefill" or load.running <= 0:
            return min(queued, horizon_s)
        left = load.decode_tokens_left
        if left is None:
            return horizon_s
        # the batch's tokens spread over its sequences: how long it keeps stepping, about (a stop
        # ends one sooner, a long one stays after the others)
        df = self._fit(worker, "decode", pool, PRIOR_DECODE)
        steps = math.ceil(max(left, 0) / load.running)
        return min(queued + steps * (df.fixed + df.per_unit * load.running), horizon_s)

    def share_factor(self, worker: Any, seconds: float, pool: list[Any]) -> float:
        """How much longer ``seconds`` of stepping on ``worker`` take for turns at cores it shares:
        the threads stepping on its board meanwhile over the board's cores (1 on cores of its own)."""
        others = _board_mates(worker, pool)
        if not others or seconds <= 0 or self.share_weight == 0:
            return 1.0
        threads = worker.load.step_threads + self._contention(others, seconds, pool)
        return max(1.0, threads / worker.load.board_cores)

    def stepping_s(self, worker: Any, prefill_tokens: int, decode_tokens: int, pool: list[Any]) -> float:
        """Core time ``worker`` spends on a request's tokens: their per-token and per-sequence parts,
        a prompt's step whole on an idle worker, and each decode step's overhead shared with the
        sequences decoding there (all of it on a worker decoding nothing).

        A decode step's overhead (the weights read once whatever the batch) is paid as long as the
        worker decodes anything: a request added to a small batch keeps a worker stepping that
        would soon go idle, one added to a large batch shares steps that happen anyway. Priced at
        the margin alone (nothing on a worker that steps), two decode workers on one board stay
        busy side by side with half batches, each paying the overhead, where one could do both."""
        pf, df = self._fit(worker, "prefill", pool, PRIOR_PREFILL), self._fit(worker, "decode", pool, PRIOR_DECODE)
        prefill = pf.per_unit * prefill_tokens
        if prefill_tokens and not _stepping(worker):
            prefill += pf.fixed
        sharing = (worker.load.running if worker.role != "prefill" else 0) + 1
        decode = (df.per_unit + df.fixed / sharing) * decode_tokens
        return prefill + decode

    def board_s(self, worker: Any, seconds: float, pool: list[Any]) -> float:
        """What ``seconds`` of stepping added on ``worker`` cost the requests of its board mates.

        Where the board's workers want more cores than it has, the added time is taken from the
        mates that want them, and each of their requests waits for it. A mate wants cores while it
        steps (decoding, until its sequences' tokens run out) and as often as it did lately
        (``WorkerLoad.demand``): a board that is busy on the whole is priced as such, whichever of
        its workers is idle this instant.
        """
        mates = _board_mates(worker, pool)
        load = worker.load
        if self.share_weight == 0 or not mates or seconds <= 0:
            return 0.0
        wants = [self._wants(w, seconds, pool) for w in mates]
        threads = sum(a * w.load.step_threads for a, w in zip(wants, mates))
        over = min(max(threads + load.step_threads - load.board_cores, 0.0), load.step_threads)
        if over <= 0 or threads <= 0:
            return 0.0
        requests = sum(a * max(w.load.running, 1) for a, w in zip(wants, mates))
        return self.share_weight * seconds * over * requests / threads

    def _wants(self, worker: Any, seconds: float, pool: list[Any]) -> float:
        """The share of the next ``seconds`` ``worker`` wants its cores: all of it while it steps
        (a decoding one, while its sequences have tokens left), and as often as it did lately."""
        lately = min(max(worker.load.demand, 0.0), 1.0)
        if worker.role != "prefill" and worker.load.running > 0:
            return max(self.busy_s(worker, seconds, pool) / seconds, lately)
        return 1.0 if _stepping(worker) else lately

    def _contention(self, others: list[Any], horizon_s: float, pool: list[Any]) -> float:
        """Threads the board's other workers step with, averaged over the horizon."""
        return sum(w.load.step_threads * self.busy_s(w, horizon_s, pool) for w in others) / horizon_s


def _stepping(worker: Any) -> bool:
    # a prefill worker's requests in flight wait for their shipment once prefilled: not stepping
    return worker.load.pending_prefill > 0 or (worker.role != "prefill" and worker.load.running > 0)


def _board_mates(worker: Any, pool: Iterable[Any]) -> list[Any]:
    board = worker.load.core_board
    if not board or worker.load.board_cores <= 0:
        return []
    return [w for w in pool if w is not worker and w.load.core_board == board]


def _mates(worker: Any, pool: Iterable[Any], kind: Callable[[Any], Any]) -> list[Any]:
    """The workers of ``pool`` of ``worker``'s kind (``worker`` among them), in a stable order;
    ``worker`` alone where it names no hardware."""
    if not worker.load.hardware:
        return [worker]
    mine = kind(worker)
    mates = sorted((w for w in pool if w.load.hardware and kind(w) == mine), key=lambda w: w.worker_id)
    if not any(w is worker for w in mates):
        mates.append(worker)
    return mates


def _measured(cost: LinearCost) -> bool:
    return cost.fitted and any(cost.sums)
