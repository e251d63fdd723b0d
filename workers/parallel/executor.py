"""Rank 0's side of a tensor-parallel replica: start ranks 1..N-1, join their group, send them the
cache size and then one plan per step.

Ranks run in processes started here (``mp``, what ``LLM`` uses) or in Ray actors placed in the
placement group of the worker that owns them (``ray``, what the cluster uses); each backend is
one class registered by name, as vLLM's ``distributed_executor_backend``.
"""

from __future__ import annotations

import dataclasses
import json
import secrets
import subprocess
import sys
import uuid
from collections.abc import Callable
from typing import Any, Protocol

from baton_serve.workers.engine.step_plan import StepPlan
from baton_serve.workers.parallel.group import TPGroup, TPRendezvous, group_backend, listen_store
from baton_serve.workers.parallel.kv_agent import AgentListener, RemoteAgent
from baton_serve.workers.parallel.plan_channel import PlanSender
from baton_serve.workers.parallel.rank import RankSpec, runner_setup, serve_rank


class RankHosts(Protocol):
    """Where ranks 1..N-1 run: started together, stopped together."""

    def start(self, specs: list[RankSpec]) -> None: ...

    def stop(self) -> None: ...


class ProcessRanks:
    """Each rank in a fresh interpreter on this machine (``python -m baton_serve.workers.parallel.rank``):
    no forked OpenMP state, and no re-import of the caller's main module as ``spawn`` would do."""

    def __init__(self) -> None:
        self._procs: list[subprocess.Popen[bytes]] = []

    def start(self, specs: list[RankSpec]) -> None:
        for spec in specs:
            self._procs.append(subprocess.Popen(
                [sys.executable, "-m", "baton_serve.workers.parallel.rank", json.dumps(dataclasses.asdict(spec))],
                stdin=subprocess.DEVNULL))

    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def failed(self) -> str | None:
        """Why a rank will never join: it exited already."""
        for rank, proc in enumerate(self._procs, start=1):
            if proc.poll() is not None:
                return f"tensor-parallel rank {rank} exited with status {proc.returncode} before joining"
        return None

    def stop(self) -> None:
        for proc in self._procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
        self._procs.clear()


class RayRanks:
    """Each rank in a Ray actor: in the placement group of the actor creating them (bundles 1..N-1,
    bundle 0 being that actor's), else pinned to its node."""

    def __init__(self, num_cpus: float = 1.0, num_gpus: float = 0.0) -> None:
        self.num_cpus, self.num_gpus = num_cpus, num_gpus
        self.actors: list[Any] = []
        self._runs: list[Any] = []

    def start(self, specs: list[RankSpec]) -> None:
        import ray
        from ray.util.placement_group import get_current_placement_group
        from ray.util.scheduling_strategies import (
            NodeAffinitySchedulingStrategy,
            PlacementGroupSchedulingStrategy,
        )

        pg = get_current_placement_group()
        actor_cls = ray.remote(RankActor)
        for spec in specs:
            if pg is not None:
                strategy: Any = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=spec.rank)
            else:
                strategy = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
            actor = actor_cls.options(num_cpus=self.num_cpus, num_gpus=self.num_gpus, scheduling_strategy=strategy,
                                      max_restarts=0, max_concurrency=2).remote()  # pid() answers while serve runs
            self.actors.append(actor)
            self._runs.append(actor.serve.remote(spec))

    def stop(self) -> None:
        import ray

        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        self.actors.clear()
        self._runs.clear()


class RankActor:
    """A Ray actor that runs one rank (``serve_rank``) for its whole life."""

    def serve(self, spec: RankSpec) -> int:
        return serve_rank(spec)

    def pid(self) -> int:
        import os

        return os.getpid()


RANK_HOSTS: dict[str, Callable[..., RankHosts]] = {"mp": ProcessRanks, "ray": RayRanks}


class TPExecutor:
    """Rank 0 of a replica: ``group`` for the model's all-reduces, ``send_plan`` for each step."""

    def __init__(self, world_size: int, base: RankSpec, backend: str = "mp", host: str = "127.0.0.1",
                 timeout_s: float = 60.0, **host_options: Any) -> None:
        """Start ranks 1..N-1 from ``base`` (its rank and rendezvous are filled in per rank) and join
        them; raises ``TensorParallelError`` (everything stopped) when one does not come up in time."""
        if backend not in RANK_HOSTS:
            raise ValueError(f"distributed_executor_backend must be one of {sorted(RANK_HOSTS)}, got {backend!r}")
        self.world_size = world_size
        sock, store = listen_store(host, world_size, timeout_s)
        self.sender = PlanSender(host, world_size, secrets.token_hex(16))
        self.agent_listener = AgentListener(host, world_size, self.sender.secret)
        self.agents: list[RemoteAgent] = []  # ranks 1..N-1's KV agents, once they have a cache
        self.timeout_s = timeout_s
        self.rendezvous = TPRendezvous(host, sock.getsockname()[1], self.sender.port, world_size,
                                       f"tp-{uuid.uuid4().hex[:12]}", self.sender.secret,
                                       group_backend(base.device), timeout_s, self.agent_listener.port)
        self.ranks = RANK_HOSTS[backend](**host_options)
        self._sock = sock
        self.group: TPGroup | None = None
        try:
            # processes here on a machine with several GPUs: rank r on GPU r (Ray gives each actor its own)
            per_gpu = backend == "mp" and base.device.startswith("cuda")
            self.ranks.start([dataclasses.replace(base, rank=r, rendezvous=dataclasses.asdict(self.rendezvous),
                                                  device=f"cuda:{r}" if per_gpu else base.device)
                              for r in range(1, world_size)])
            self.group = TPGroup(self.rendezvous, 0, base.device, store=store,
                                 failed=getattr(self.ranks, "failed", None))
            self.sender.accept(timeout_s)
        except BaseException:
            self.close()
            raise

    def setup_runner(self, num_blocks: int, block_size: int, num_host_blocks: int) -> None:
        """Every other rank allocates the same cache (its own KV heads) before the first step."""
        self.sender.send(runner_setup(num_blocks, block_size, num_host_blocks))
        self.agents = self.agent_listener.accept(self.timeout_s)

    def failure(self) -> str | None:
        """Why this replica can no longer step (a rank is gone), or None."""
        lost = self.sender.lost
        return None if lost is None else f"tensor-parallel rank {lost} of {self.world_size} is gone"

    def send_plan(self, plan: StepPlan) -> None:
        self.sender.send(plan.encode())

    def close(self) -> None:
        """Stop every rank (idempotent): they read end-of-file and exit; stragglers are killed."""
        self.sender.close()
        self.agent_listener.close()
        for agent in self.agents:
            agent.close()
        if self.group is not None:
            self.group.close()
        self.ranks.stop()
        self._sock.close()
