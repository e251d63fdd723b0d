"""Starts Ray (or joins a cluster), the worker pools, and hands the front its ``WorkerRef``s."""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import logging
import math
import os
import secrets
from pathlib import Path
from typing import Any

from baton_serve.cluster.config import ClusterConfig
from baton_serve.cluster.front.workers import WorkerRef
from baton_serve.cluster.placement_groups import (
    check_pool_sizes,
    in_bundle_zero,
    model_config_here,
    rank_bundles,
    release,
    reserve,
    uses_tensor_parallel,
)
from baton_serve.cluster.restarts import WorkerSpec
from baton_serve.kernels import capabilities
from baton_serve.workers.actor.core_share import create_board, remove_board
from baton_serve.workers.engine.validation import RequestLimits

log = logging.getLogger("baton.launcher")


def init_ray(config: ClusterConfig, num_cpus: int | None = None) -> bool:
    """``ray.init`` on loopback unless Ray is already up; returns True when this call started it."""
    import ray

    if ray.is_initialized():
        return False
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": True}
    if config.ray.address is None:
        kwargs.update(address="local", _node_ip_address="127.0.0.1",
                      num_cpus=num_cpus or config.ray.num_cpus or os.cpu_count() or 2,
                      object_store_memory=512 << 20)
    else:
        kwargs["address"] = config.ray.address
    ray.init(namespace=config.ray.namespace, **kwargs)
    return True


# ~1 ms of spinning on these CPUs: longer than the gaps between a step's parallel
# regions, far shorter than libgomp's default (~9 ms) that outlives the step. Only where the
# OpenMP runtime cannot end a team on demand (kernels.openmp.release_team).
SHARE_SPINCOUNT = "30000"


def openmp_plan(config: ClusterConfig) -> tuple[str, dict[str, str]]:
    """How the workers' OpenMP threads wait: (mode, environment for the workers).

    Spinning (libgomp's default: ~300k spins, then sleep) keeps a decode step's ~200 parallel
    regions from each waking a sleeping thread (55-75 us each on a VM, ~20% of the step). It
    needs a core per spinning thread. Where local workers' threads outnumber the cores, ``share``
    keeps spinning but each step waits for its turn at the cores (``workers.actor.core_share``), so
    running threads never outnumber them. ``passive`` (sleep at once) is for a cluster whose
    cores this process cannot see, without ``cpus_per_worker`` reservations. An
    ``OMP_WAIT_POLICY`` set by the user is passed on as it is.

    libgomp's default spin outlasts a step by ~9 ms on these VMs, on a core the next worker's
    step is already using, which slowed each step after a turn passed by ~20%
    (``benchmarks/core_share_handoff.py``). So a sharing worker ends its team when it hands the
    cores to a waiting worker (``kernels.openmp.release_team``) and keeps the default spin
    otherwise: a short spin (``SHARE_SPINCOUNT``) put the team to sleep several times a step
    in the gaps between regions, each wake-up a few percent of a decode step. Where the runtime
    cannot end a team, sharing workers get the short spin. A ``GOMP_SPINCOUNT`` set by the user
    is passed on as it is.

    A tensor-parallel replica counts ``tensor_parallel_size x threads`` cores: its ranks step
    together. The board seats one worker per replica and counts its rank 0's threads only, so
    where such replicas outnumber the cores ``auto`` sleeps (passive) rather than shares.
    """
    if "OMP_WAIT_POLICY" in os.environ:
        return "user", {"OMP_WAIT_POLICY": os.environ["OMP_WAIT_POLICY"]}
    mode = config.engine.openmp_wait
    if mode == "auto":
        mode = _auto_wait(config)
    if mode == "share" and config.ray.address is not None:
        raise ValueError("engine.openmp_wait = 'share' needs a local deployment (its board is a file "
                         "on this machine); on a cluster reserve cores with pools.cpus_per_worker")
    if mode == "passive":
        return mode, {"OMP_WAIT_POLICY": "PASSIVE"}
    if mode == "share":
        if uses_tensor_parallel(config):
            log.warning("engine.openmp_wait = 'share' with tensor_parallel_size > 1: the board counts "
                        "each replica's rank 0 only, so its other ranks' threads may oversubscribe the cores")
        if "GOMP_SPINCOUNT" in os.environ:
            return mode, {"GOMP_SPINCOUNT": os.environ["GOMP_SPINCOUNT"]}
        return mode, {} if _torch_runtime_can_release() else {"GOMP_SPINCOUNT": SHARE_SPINCOUNT}
    return mode, {}


def _auto_wait(config: ClusterConfig) -> str:
    """``openmp_wait = "auto"``: spin where every replica's threads have cores of their own (Ray
    reserves them, or local replicas' ranks x threads fit this machine), else share or sleep."""
    local = config.ray.address is None
    demand, reserved, parallel = 0, True, False
    for role in config.pools.replica_roles():
        threads = worker_threads(config, role)
        if threads is None:  # a cluster without reservations: cores unknown here
            return "passive"
        tp = config.pools.options_for(role).tensor_parallel_size
        demand += tp * threads
        parallel = parallel or tp > 1
        # a replica's placement group reserves CPUs for each of its ranks' threads (rank_bundles)
        reserved = reserved and (tp > 1 or config.pools.cpus_per_worker >= threads)
    if reserved or (local and demand <= _usable_cpus()):
        return "spin"
    return "share" if local and not parallel else "passive"


def _torch_runtime_can_release() -> bool:
    """Whether the installed torch's OpenMP runtime has ``omp_pause_resource_all``, checked by
    opening the library file (libgomp, which torch's wheels bundle) without importing torch."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return False
    for path in sorted(Path(next(iter(spec.submodule_search_locations)), "lib").glob("libgomp*.so*")):
        try:
            return hasattr(ctypes.CDLL(str(path)), "omp_pause_resource_all")
        except OSError:
            continue
    return False


def _usable_cpus() -> int:
    return capabilities.usable_cores()


def actor_options(config: ClusterConfig, role: str, group: Any = None) -> dict[str, Any]:
    """Ray placement for one worker of ``role``: its CPUs, the custom resources its pool is pinned
    by, and SPREAD across nodes unless the config packs them; in bundle 0 of ``group`` (a
    tensor-parallel replica's placement group, whose bundles carry the custom resources) instead."""
    options: dict[str, Any] = {"num_cpus": config.pools.cpus_per_worker}
    gpus = worker_gpus(config, role)
    if group is not None:
        if gpus:
            options["num_gpus"] = gpus
        options["scheduling_strategy"] = in_bundle_zero(group)
        return options
    if gpus:
        options["num_gpus"] = gpus  # Ray sets the actor's CUDA_VISIBLE_DEVICES to what it grants
    resources = config.pools.resources_for(role)
    if resources:
        options["resources"] = resources
    if config.pools.spread:
        options["scheduling_strategy"] = "SPREAD"
    return options


def gpus_per_worker(config: ClusterConfig) -> float:
    """GPUs one worker asks Ray for: as configured, else (``auto``) 1 each where the engine runs on
    CUDA and the cluster has a GPU per worker, an equal share of them where it has fewer (two
    workers on one GPU: 0.5 each), and 0 on CPUs."""
    gpus = config.pools.gpus_per_worker
    if gpus != "auto":
        return float(gpus)
    device = config.engine.device
    if device == "cpu":
        return 0.0
    import ray

    have = ray.cluster_resources().get("GPU", 0.0) if ray.is_initialized() else 0.0
    if not have:
        return 1.0 if device.startswith("cuda") else 0.0  # cuda: Ray says so if none is free
    ranks = sum(config.pools.options_for(r).tensor_parallel_size for r in config.pools.replica_roles())
    return 1.0 if have >= ranks else math.floor(100 * have / ranks) / 100


def worker_gpus(config: ClusterConfig, role: str) -> float:
    """GPUs the worker (rank 0) of one ``role`` replica asks for: a whole one per rank where a
    replica has several (NCCL puts one rank on each device), else ``gpus_per_worker``."""
    gpus = gpus_per_worker(config)
    return (1.0 if gpus else 0.0) if config.pools.options_for(role).tensor_parallel_size > 1 else gpus


def worker_engine_kwargs(config: ClusterConfig) -> dict[str, Any]:
    """The ``[engine]`` section as a Worker's engine arguments, in the engine's own names."""
    eng = config.engine
    kwargs = eng.model_dump(exclude={"threads_per_worker", "openmp_wait", "scheduling_policy",
                                     "long_prefill_token_threshold"})
    kwargs["policy"] = eng.scheduling_policy
    if eng.long_prefill_token_threshold is not None:
        kwargs["max_prefill_chunk"] = eng.long_prefill_token_threshold
    return kwargs


def pool_engine_kwargs(config: ClusterConfig, role: str, threads: int | None) -> dict[str, Any]:
    """A ``role`` worker's engine arguments: ``[engine]``, the pool's overrides, and its
    tensor-parallel layout (ranks as Ray actors in the replica's placement group, ``threads`` each).
    Needs Ray up (the GPU share asks it)."""
    options = config.pools.options_for(role)
    kwargs = worker_engine_kwargs(config)
    for name in ("max_num_batched_tokens", "max_num_seqs"):
        if getattr(options, name) is not None:
            kwargs[name] = getattr(options, name)
    tp = options.tensor_parallel_size
    # Workers sharing a GPU each size their KV cache from their part of it; ranks have a GPU each.
    kwargs["gpu_memory_utilization"] = gpu_memory_share(config) if tp == 1 else config.engine.gpu_memory_utilization
    if tp > 1:
        kwargs.update(tensor_parallel_size=tp, distributed_executor_backend="ray")
        if threads is not None:  # each rank sets it, and its actor asks Ray for that many CPUs
            kwargs["num_threads"] = threads
    return kwargs


def replica_bundles(config: ClusterConfig, role: str) -> list[dict[str, float]]:
    """The placement group bundles of one ``role`` replica: each covers what its rank's actor asks
    (``threads`` CPUs, 1 where unknown; rank 0 asks ``cpus_per_worker``) and a GPU on CUDA."""
    threads = worker_threads(config, role)
    cpus = max(config.pools.cpus_per_worker, float(threads or 1))
    return rank_bundles(config.pools.options_for(role).tensor_parallel_size, cpus,
                        worker_gpus(config, role) > 0, config.pools.resources_for(role))


def gpu_memory_share(config: ClusterConfig) -> float:
    """Each worker's ``gpu_memory_utilization``: the configured share of a GPU, times the part of
    the GPU the worker gets when workers share one."""
    share = gpus_per_worker(config)
    return config.engine.gpu_memory_utilization * (share if 0 < share < 1 else 1.0)


def worker_threads(config: ClusterConfig, role: str | None = None) -> int | None:
    """Threads per worker (per rank of a ``role`` replica): the pool's ``threads``, else
    ``engine.threads_per_worker``; ``auto`` fills the cores a worker is given: ``pools.cpus_per_worker``
    where reserved, else this machine's cores for a local deployment, split among a replica's ranks
    (workers whose threads outnumber the cores take turns at them, see ``openmp_plan``). None on a
    cluster without reservations: each worker then takes the cores of the machine it lands on."""
    pool = config.pools.options_for(role) if role is not None else None
    if pool is not None and pool.threads is not None:
        return pool.threads
    threads = config.engine.threads_per_worker
    if threads != "auto":
        return int(threads)
    if config.pools.cpus_per_worker >= 1:
        return int(config.pools.cpus_per_worker)
    if config.ray.address is not None:
        return None
    return max(_usable_cpus() // (pool.tensor_parallel_size if pool else 1), 1)


def check_same_dtype(workers: list[WorkerRef]) -> None:
    """Workers exchange KV blocks and share prefix-cache namespaces: they must run one dtype. With
    ``dtype = "auto"`` on machines of different CPU kinds they may not; say so instead of failing
    requests later."""
    dtypes = {w.info.get("dtype") for w in workers}
    if len(dtypes) > 1:
        found = ", ".join(f"{w.worker_id} {w.info.get('dtype')}" for w in workers)
        raise ValueError(f"workers resolved engine.dtype to different dtypes ({found}): their machines "
                         "differ in native bf16 support; set engine.dtype (or --dtype) explicitly")


def check_same_device_kind(workers: list[WorkerRef]) -> None:
    """KV blocks travel between the caches of prefill and decode workers over one pair group:
    gloo between CPU caches, NCCL between CUDA ones, never a mix. With ``device = "auto"`` on a
    cluster where only some nodes have GPUs they could mix; say so at start."""
    kinds = {str(w.info.get("device", "cpu")).split(":")[0] for w in workers}
    if len(kinds) > 1:
        found = ", ".join(f"{w.worker_id} {w.info.get('device')}" for w in workers)
        raise ValueError(f"workers resolved engine.device to different kinds ({found}): set engine.device "
                         "(or --device) explicitly, or pin the pools to nodes of one kind")


class Cluster:
    """The worker actors of one deployment. ``start`` blocks until every worker has loaded its model."""

    def __init__(self, config: ClusterConfig) -> None:
        self.config = config
        self.workers: list[WorkerRef] = []
        self.controller: Any = None
        self._started_ray = False
        self.named = False
        self._board: Path | None = None  # the core-share board of workers sharing this machine
        self._groups: list[Any] = []  # tensor-parallel replicas' placement groups, removed at stop
        # The workers' output sockets serve only fronts that know it (one per deployment).
        self.front_secret = secrets.token_hex(16)

    def roles(self) -> list[str]:
        return self.config.pools.replica_roles()

    def start(self) -> None:
        import ray
        from baton_serve.workers.actor.worker import Worker

        roles = self.roles()
        mode, omp_env = openmp_plan(self.config)  # config errors before Ray starts
        if uses_tensor_parallel(self.config):
            model = model_config_here(self.config)
            if model is not None:  # a size the model cannot be split into fails here, not in a worker
                check_pool_sizes(self.config, model)
        self._started_ray = init_ray(self.config)
        # Named actors where this deployment opened the Ray connection, so it owns the namespace
        # (``baton serve``): operators find them with ray.get_actor(name, namespace=...). A caller
        # that brought its own Ray session (a test, a notebook) may run several deployments in it.
        self.named = self._started_ray
        pending: list[tuple[str, str, Any]] = []
        try:
            if mode == "share":
                self._board = create_board(len(roles))
            self._start_workers(Worker, roles, omp_env, pending)
        except BaseException:  # a worker failed to start: leave no actor, board or Ray behind
            for _, _, handle in pending:
                with contextlib.suppress(Exception):
                    ray.kill(handle)
            self.workers = []
            self.stop()
            raise
        log.info("workers ready: %s", ", ".join(w.worker_id for w in self.workers))

    def _reserve_groups(self, roles: list[str]) -> list[Any]:
        """One ready placement group per tensor-parallel replica (None for single-rank ones), all
        before any worker starts: a pool too large for the cluster fails before a model loads."""
        groups: list[Any] = []
        for role in roles:
            options = self.config.pools.options_for(role)
            if options.tensor_parallel_size == 1:
                groups.append(None)
                continue
            group = reserve(role, options.tensor_parallel_size, replica_bundles(self.config, role),
                            options.placement_strategy, self.config.pools.placement_timeout_s)
            self._groups.append(group)
            groups.append(group)
        return groups

    def _pool_setup(self, role: str, omp_env: dict[str, str]) -> tuple[dict[str, Any], int | None, dict[str, str]]:
        """A ``role`` worker's engine arguments, threads (per rank) and environment."""
        threads = worker_threads(self.config, role)
        # No GLOO_SOCKET_IFNAME: each pair group pins gloo to the interface that reaches its peer.
        env = {"TOKENIZERS_PARALLELISM": "false", **omp_env}
        if threads is not None:
            env["OMP_NUM_THREADS"] = str(threads)
        return pool_engine_kwargs(self.config, role, threads), threads, env

    def _start_workers(self, worker_cls: type, roles: list[str], omp_env: dict[str, str],
                       pending: list[tuple[str, str, Any]]) -> None:
        import ray

        actor_cls = ray.remote(worker_cls)
        cores = _usable_cpus()
        counters: dict[str, int] = {}
        specs: dict[str, WorkerSpec] = {}
        setups = {role: self._pool_setup(role, omp_env) for role in dict.fromkeys(roles)}
        groups = self._reserve_groups(roles)
        for slot, (role, group) in enumerate(zip(roles, groups)):
            counters[role] = counters.get(role, 0) + 1
            wid = f"{role}-{counters[role] - 1}"
            engine_kwargs, threads, env = setups[role]
            share = ({"path": str(self._board), "slot": slot, "cores": cores}
                     if self._board is not None else None)
            # Kept for the controller, which starts the worker again the same way when it dies (in
            # the same placement group: its ranks' bundles are free again once they died with it).
            spec = specs[wid] = WorkerSpec(
                wid, role, worker_cls,
                {**actor_options(self.config, role, group), "max_concurrency": 32,
                 "runtime_env": {"env_vars": env}, **self.actor_name(wid)},
                (wid, role, engine_kwargs, threads, self.config.kv_transfer.transport,
                 self.config.kv_transfer.timeout_s),
                {"core_share": share, "front_secret": self.front_secret,
                 "verify_kv": self.config.kv_transfer.verify_checksums})
            handle = actor_cls.options(**spec.options).remote(*spec.args, **spec.kwargs)
            pending.append((wid, role, handle))
        infos = ray.get([h.info.remote() for _, _, h in pending])
        self.workers = [WorkerRef(wid, role, h, info) for (wid, role, h), info in zip(pending, infos)]
        check_same_dtype(self.workers)
        check_same_device_kind(self.workers)
        peers = {w.worker_id: w.handle for w in self.workers}
        ray.get([w.handle.set_peers.remote(peers) for w in self.workers])
        from baton_serve.cluster.controller import GlobalController
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        # With the fronts, on the node that started the deployment (the head, as a rule): placed on
        # a worker's node, losing that node would also lose the view of every other worker.
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        # Ray restarts the controller when it dies; started with the members, it rebuilds its view
        # from the workers. Named, it outlives its creator's handle as a detached actor.
        named = self.actor_name("controller")
        self.controller = ray.remote(GlobalController).options(
            **named, **({"lifetime": "detached"} if named else {}), num_cpus=0, max_concurrency=8,
            scheduling_strategy=here, max_restarts=-1,
        ).remote(self.config.server.max_queued_requests, restart=self.config.recovery.restart_policy(),
                 members=[(specs[w.worker_id], w.handle) for w in self.workers],
                 drain_grace_s=self.config.rebalance.drain_grace_s,
                 drain_timeout_s=self.config.rebalance.drain_timeout_s,
                 rebalance=self.config.rebalance.model_dump())
        ray.get(self.controller.snapshot.remote())

    def actor_name(self, name: str) -> dict[str, Any]:
        """Ray actor options naming one of this deployment's actors (none when it is not named)."""
        if not self.named:
            return {}
        import ray

        try:
            ray.get_actor(name, namespace=self.config.ray.namespace)
        except ValueError:
            return {"name": name, "namespace": self.config.ray.namespace}
        raise RuntimeError(f"Ray namespace {self.config.ray.namespace!r} already has an actor named {name!r}: "
                           "another deployment runs there; give this one its own [ray] namespace")

    @property
    def model_path(self) -> Path:
        return Path(self.workers[0].info["model_path"])

    @property
    def limits(self) -> RequestLimits:
        """What every request must fit: the smallest cache among the workers."""
        infos = [w.info for w in self.workers]
        return RequestLimits(vocab_size=infos[0]["vocab_size"],
                             max_model_len=min(i["max_model_len"] for i in infos),
                             num_blocks=min(i["num_blocks"] for i in infos),
                             block_size=infos[0]["block_size"])

    def stop(self) -> None:
        """Shut every worker down and stop Ray if this cluster started it. Idempotent."""
        import ray

        if self._board is not None:  # workers that still map it keep their mapping
            remove_board(self._board)
            self._board = None
        if not ray.is_initialized():
            return
        handles = {w.worker_id: w.handle for w in self.workers}
        if self.controller is not None:
            with contextlib.suppress(Exception):  # the controller restarted some: theirs are current
                self.controller.shutdown.remote()
                handles.update(ray.get(self.controller.handles.remote(), timeout=10))
        for handle in handles.values():
            try:
                ray.get(handle.shutdown.remote(), timeout=10)
            except Exception:  # already dead: killing below is enough
                pass
            with contextlib.suppress(Exception):
                ray.kill(handle)
        self.workers = []
        if self.controller is not None:
            with contextlib.suppress(Exception):
                ray.kill(self.controller, no_restart=True)
            self.controller = None
        release(self._groups)  # after the workers: removing a group kills the actors in it
        self._groups = []
        if self._started_ray:
            ray.shutdown()
            self._started_ray = False
