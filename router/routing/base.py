"""What routing policies see and decide, and the registry that makes them by name.

A policy sees ``Candidates`` (the live workers of each pool with their ``WorkerLoad``, and how
many leading blocks of the prompt each one holds according to the prefix index) and returns a
``Decision``: the worker that runs the prompt, and the decode worker it continues on (None when
it stays where it was prefilled: colocated pools, or a short prompt prefilled on its decode
worker). Policies never see a worker's scheduler or call a worker.
"""

from __future__ import annotations

import inspect
import math
import time
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

from baton_serve.router.routing.rates import LinearCost, StepFit
from baton_serve.workers.registry import Registry


@dataclass
class WorkerLoad:
    """What the front knows about a worker's load and speed.

    ``outstanding``, ``local_pending_prefill``, ``local_pending_requests`` and ``local_decode_left``
    are this front's own exact counts; the rest come
    from the worker's last stats snapshot (seconds old). The three ``LinearCost`` fits are its
    prefill step time (per prompt token), decode step time (per running sequence) and KV shipment
    time (per byte), measured from the snapshots' cumulative counters.
    """

    outstanding: int = 0  # requests this front has in flight on the worker
    local_pending_prefill: int = 0  # prompt tokens this front sent that have not produced a token
    local_pending_requests: int = 0  # the requests those tokens belong to
    local_decode_left: int = 0  # output tokens this front's requests decoding there may still produce
    sole_front: bool = True  # no other front sends work: the local counts are the whole truth
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_free_blocks: int = 0
    num_blocks: int = 0
    reported_pending_prefill: int = 0
    step_token_budget: int = 0  # tokens one step computes at most (0: not reported)
    prefill_chunk: int = 0  # tokens of one prompt a step computes at most (0: no cap below the budget)
    prefill: LinearCost = field(default_factory=LinearCost)
    decode: LinearCost = field(default_factory=lambda: LinearCost(fallback="fixed"))
    ship: LinearCost = field(default_factory=lambda: LinearCost(min_units=1024.0))
    step: StepFit = field(default_factory=StepFit)  # the three terms of a step, fitted to steps
    # Workers naming one board take turns at its cores (workers.actor.core_share): a step asks for
    # ``step_threads`` of them. Empty on hardware of the worker's own (a GPU, a reserved CPU).
    core_board: str = ""
    board_cores: int = 0
    step_threads: int = 1
    # The device, threads, dtype and model a worker steps with: workers reporting the same one fit
    # their steps together (``CostModel``), so identical workers do not differ by fit noise.
    hardware: str = ""
    # Share of the recent time it stepped or waited for its turn at the cores: how often it wants
    # them, idle or busy this instant (an average over stats intervals, the newest weighing half).
    demand: float = 0.0
    _wanted_last: tuple[float, float] | None = field(default=None, repr=False)

    def update(self, stats: dict[str, Any], now: float | None = None) -> None:
        self.num_running = int(stats.get("num_running", 0))
        self.num_waiting = int(stats.get("num_waiting", 0))
        self.kv_cache_usage = float(stats.get("kv_cache_usage", 0.0))
        self.num_free_blocks = int(stats.get("num_free_blocks", 0))
        self.num_blocks = int(stats.get("num_blocks", 0))
        self.reported_pending_prefill = int(stats.get("pending_prefill_tokens", 0))
        self.step_token_budget = int(stats.get("step_token_budget", 0))
        self.prefill_chunk = int(stats.get("prefill_chunk", 0))
        prefill_s = float(stats.get("prefill_seconds", 0.0))
        self.prefill.observe(stats.get("num_prefill_steps", 0), stats.get("num_prefill_tokens_computed", 0),
                             prefill_s)
        self.decode.observe(stats.get("num_decode_steps", 0), stats.get("num_decode_tokens_computed", 0),
                            max(float(stats.get("busy_seconds", 0.0)) - prefill_s, 0.0))
        self.step.observe(stats.get("step_moments"))
        extra = stats.get("extra") or {}
        share = extra.get("core_share") or {}
        self.core_board, self.board_cores = str(share.get("board", "")), int(share.get("cores", 0))
        self.step_threads = max(int(share.get("threads", 1)), 1)
        self.hardware = str(extra.get("hardware", ""))
        self._observe_demand(float(stats.get("busy_seconds", 0.0)) + float(extra.get("core_wait_seconds", 0.0)),
                             time.monotonic() if now is None else now)
        transfer = extra.get("kv_transfer") or {}
        if "shipments" in transfer:
            self.ship.observe(transfer["shipments"], transfer.get("bytes", 0), transfer.get("ship_seconds", 0.0))

    def _observe_demand(self, wanted_s: float, now: float) -> None:
        last, self._wanted_last = self._wanted_last, (wanted_s, now)
        if last is None or now <= last[1] or wanted_s < last[0]:  # first report, or restarted
            return
        share = min((wanted_s - last[0]) / (now - last[1]), 1.0)
        self.demand = 0.5 * self.demand + 0.5 * share

    def fit(self, kind: str, steps: bool = True, step: StepFit | None = None,
            interval: LinearCost | None = None) -> tuple[float, float] | None:
        """(seconds a step, seconds per unit) of ``kind`` (``prefill``: per prompt token, ``decode``:
        per running sequence, ``ship``: per byte), or None before this worker measured it. The
        step fit (``step``, else this worker's own) where the steps tell that term apart (and
        ``steps``), else the interval fit (``interval``, else this worker's own)."""
        step = step or self.step
        if steps and kind == "prefill" and step.prefill_fitted:
            return step.overhead, step.per_prefill_token
        if steps and kind == "decode" and step.decode_fitted:
            return step.overhead, step.per_decode_seq
        cost: LinearCost = interval or getattr(self, kind)
        return (cost.fixed, cost.per_unit) if cost.fitted else None

    @property
    def pending_prefill(self) -> int:
        """Prompt tokens queued ahead of a new request. The sole front's own count is exact and
        current; the worker's report is up to a stats interval old (it may still hold requests
        long done), so it counts only where other fronts send work too."""
        if self.sole_front:
            return self.local_pending_prefill
        return max(self.reported_pending_prefill, self.local_pending_prefill)

    @property
    def pending_requests(self) -> int:
        """Requests whose prompts make up ``pending_prefill``, by the same rule (the worker's
        report: those waiting for a step)."""
        if self.sole_front:
            return self.local_pending_requests
        return max(self.num_waiting, self.local_pending_requests)

    @property
    def decode_tokens_left(self) -> int | None:
        """Output tokens the sequences decoding there may still produce (at most: a stop ends one
        sooner); None where other fronts send work too, whose requests this front cannot see."""
        return self.local_decode_left if self.sole_front else None

    @property
    def running(self) -> int:
        """Sequences decoding there, by the same rule as ``pending_prefill``."""
        return self.outstanding if self.sole_front else max(self.num_running, self.outstanding)


class WorkerView(Protocol):
    worker_id: str
    role: str
    load: WorkerLoad


@dataclass
class RouteRequest:
    """A request as routing sees it: its length, its prompt's block-hash chain, its output budget."""

    prompt_len: int
    block_hashes: list[bytes]  # chain hashes of the prompt's full blocks a cache hit may cover
    block_size: int
    max_tokens: int = 16
    kv_block_bytes: int = 0

    @property
    def num_blocks(self) -> int:
        """Blocks the prompt's KV fills (the last one possibly partly)."""
        return math.ceil(self.prompt_len / self.block_size)

    def uncached(self, matched_blocks: int) -> int:
        """Prompt tokens a worker holding ``matched_blocks`` leading blocks must compute (at least
        one: the last position is computed for its logits)."""
        return max(self.prompt_len - matched_blocks * self.block_size, 1)


@dataclass
class Candidates:
    """The live workers a policy chooses among, and each one's prefix match in blocks."""

    first: list[Any]  # prefill workers, or colocated ones
    decode: list[Any] = field(default_factory=list)  # empty for colocated pools
    matched_blocks: dict[str, int] = field(default_factory=dict)
    stale: set[str] = field(default_factory=set)  # workers the index has no fresh events from
    cached_blocks: dict[str, int] = field(default_factory=dict)  # blocks each worker's prefix cache holds

    def matched(self, worker: Any) -> int:
        return self.matched_blocks.get(worker.worker_id, 0)

    def cached(self, worker: Any) -> int:
        return self.cached_blocks.get(worker.worker_id, 0)


@dataclass
class Decision:
    """Where a request runs: ``first`` prefills (and, without ``decode``, decodes too)."""

    first: Any
    decode: Any | None
    reason: str
    matched_blocks: int = 0  # prompt blocks ``first`` holds already
    estimated_ttft_s: float | None = None
    # what a pricing policy weighed: (first id, decode id or None, cost s, estimated TTFT s) per option
    considered: list[tuple[str, str | None, float, float]] = field(default_factory=list)

    @property
    def local(self) -> bool:
        """A disaggregated pool's request prefilled on its decode worker (nothing shipped)."""
        return self.decode is None and getattr(self.first, "role", "") == "decode"


class RoutingPolicy:
    """Base class: ``route`` picks the workers. Subclasses set ``name`` and register themselves."""

    name: ClassVar[str] = ""

    def route(self, request: RouteRequest, candidates: Candidates) -> Decision:
        raise NotImplementedError


def _load_builtins() -> None:
    # Importing registers them; here rather than at the top, as they import this module.
    from baton_serve.router.routing.policies import cost, least_loaded, prefix, round_robin  # noqa: F401


_REGISTRY: Registry[type[RoutingPolicy]] = Registry("routing policy", _load_builtins)
register_policy = _REGISTRY.register
policy_names = _REGISTRY.names


def make_policy(name: str, seed: int | None = None, **options: Any) -> RoutingPolicy:
    """The policy registered as ``name`` (``options`` to its constructor); ValueError naming the known ones.
    ``seed`` fixes the ties a policy breaks at random (the simulator's runs repeat exactly); a policy
    without random choices takes none."""
    cls = _REGISTRY.get(name)
    if seed is not None and "seed" in inspect.signature(cls).parameters:
        options["seed"] = seed
    return cls(**options)
