"""The cluster config file (TOML), validated with errors that name the field."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import tomllib
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator


class EngineSection(BaseModel):
    """Per-worker engine settings (see ``workers.engine.config.EngineConfig``)."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="auto: bf16 where the CPU computes it natively (AVX512_BF16, AMX, Arm BF16), "
        "else fp32; decided per machine (kernels.auto_dtype)")
    device: str = Field("auto", description="auto: the first CUDA device Ray gives the worker, else the CPU; "
                        "cpu; cuda (an error at start where the worker has none)")
    block_size: int = Field(16, description="tokens per KV block")
    kv_cache_memory_gib: float = Field(1.0, gt=0, description="KV cache size on a CPU")
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1, description="on CUDA: the share of the device for "
                                          "weights, activations and the KV cache, which takes what is left")
    num_kv_blocks: int | None = Field(None, ge=1)
    max_model_len: int | None = Field(None, ge=2)
    max_num_seqs: int = Field(128, ge=1)
    max_num_batched_tokens: int = Field(1024, ge=1)
    long_prefill_token_threshold: int | None = Field(
        None, ge=1, description="the most tokens of one prompt a step computes (vLLM's name; unset: the "
        "step's budget): a long prompt then takes several steps, and the short prompts and decodes "
        "sharing them wait for a chunk rather than for the whole prompt")
    enable_prefix_caching: bool = True
    deterministic: bool = Field(
        False, description="batch-invariant numerics: a prompt's greedy output (and its logprobs, bit for "
        "bit) does not depend on its batch, the prompt's chunking, or whether its KV was decoded or "
        "re-prefilled, so recovered and migrated streams equal undisturbed ones in bf16 too; CPU "
        "workers, bf16 or fp32, full-precision weights (SGLang's --enable-deterministic-inference)")
    scheduling_policy: Literal["fcfs", "priority", "fair"] = Field(
        "fair", description="the workers' waiting queues: fcfs; priority (lower first, with aging); fair: "
        "priority classes, and tenants within a class served by deficit round robin over tokens")
    threads_per_worker: int | Literal["auto"] = Field(
        "auto", description="a worker's torch/OpenMP threads; auto fills the cores it is given: "
        "pools.cpus_per_worker where set, else every core of its machine")

    @field_validator("device")
    @classmethod
    def _known_device(cls, value: str) -> str:
        from baton_serve.kernels.device import check_device_name

        check_device_name(value)  # ValueError naming the allowed spellings
        return value

    @model_validator(mode="after")
    def _threads_positive(self) -> EngineSection:
        if self.threads_per_worker != "auto" and self.threads_per_worker < 1:
            raise ValueError("threads_per_worker must be 'auto' or >= 1")
        return self
    openmp_wait: Literal["auto", "spin", "passive", "share"] = Field(
        "auto", description="how workers' OpenMP threads use the cores: spin (libgomp's default, "
        "bounded spin-waits) where every worker thread has a core of its own; share: local workers "
        "whose threads outnumber the cores take turns at them, step by step, and spin; passive: fixed "
        "teams that sleep at every wait; auto: spin where threads fit the cores, share locally, "
        "passive on a cluster without CPU reservations")


PoolRole = Literal["prefill", "decode", "colocated"]
POOL_ROLES: tuple[PoolRole, ...] = ("prefill", "decode", "colocated")


class PoolOptions(BaseModel):
    """One pool's settings beyond its size: the ``[pools.<role>]`` table, names as in ``[engine]``.
    Unset engine fields take the ``[engine]`` section's values."""

    model_config = ConfigDict(extra="forbid")
    tensor_parallel_size: int = Field(1, ge=1, description="ranks each replica of the pool is split "
                                      "across (vLLM's name); a replica is one worker")
    max_num_batched_tokens: int | None = Field(None, ge=1)
    max_num_seqs: int | None = Field(None, ge=1)
    threads: int | None = Field(None, ge=1, description="threads per rank (engine.threads_per_worker "
                                "where unset)")
    placement_strategy: Literal["STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD"] = Field(
        "STRICT_PACK", description="tensor_parallel_size > 1: how Ray places a replica's ranks "
        "(its placement group's strategy); STRICT_PACK keeps them on one node")


class PoolsSection(BaseModel):
    """How many workers of each role. ``colocated > 0`` replaces the prefill/decode pools.

    Each role is a count (``prefill = 2``) or a table (``[pools.prefill]`` with ``replicas`` and
    the ``PoolOptions`` fields); readers always see the count, and ``options_for`` the rest."""

    model_config = ConfigDict(extra="forbid")
    prefill: int = Field(1, ge=0)
    decode: int = Field(1, ge=0)
    colocated: int = Field(0, ge=0)
    # The tables' settings; written by the [pools.<role>] form (see _tables), also accepted as is.
    prefill_options: PoolOptions = PoolOptions()
    decode_options: PoolOptions = PoolOptions()
    colocated_options: PoolOptions = PoolOptions()
    cpus_per_worker: float = Field(0.0, ge=0)
    gpus_per_worker: float | Literal["auto"] = Field(
        "auto", description="GPUs each worker asks Ray for (fractions share one); auto: 1 each where the "
        "engine runs on CUDA and the cluster has a GPU per worker, an equal share where it has fewer, else 0")
    # Placement: Ray custom resources each worker of a pool asks for (e.g. {node_a = 0.01} on a
    # node started with --resources '{"node_a": 1}'), pinning the pool to the nodes that have them.
    prefill_resources: dict[str, float] = Field(default_factory=dict)
    decode_resources: dict[str, float] = Field(default_factory=dict)
    colocated_resources: dict[str, float] = Field(default_factory=dict)
    spread: bool = Field(True, description="place a pool's workers on as many nodes as Ray can (SPREAD)")
    placement_timeout_s: float = Field(60.0, gt=0, description="how long a tensor-parallel replica's "
                                       "placement group may wait for room before start fails")

    @model_validator(mode="before")
    @classmethod
    def _tables(cls, data: Any) -> Any:
        """``[pools.prefill]`` (replicas plus options) becomes ``prefill = replicas`` and
        ``prefill_options``; a table without ``replicas`` means one replica."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        for role in POOL_ROLES:
            table = data.get(role)
            if not isinstance(table, dict):
                continue
            table = dict(table)
            data[role] = table.pop("replicas", 1)
            if f"{role}_options" in data:
                raise ValueError(f"pools.{role}: give its options in the [pools.{role}] table or in "
                                 f"{role}_options, not both")
            data[f"{role}_options"] = table
        return data

    @model_validator(mode="after")
    def _some_workers(self) -> PoolsSection:
        if self.gpus_per_worker != "auto" and self.gpus_per_worker < 0:
            raise ValueError("pools.gpus_per_worker must be 'auto' or >= 0")
        if self.colocated == 0 and (self.prefill == 0 or self.decode == 0):
            raise ValueError("pools: need prefill >= 1 and decode >= 1, or colocated >= 1")
        for role in POOL_ROLES:
            for name, amount in getattr(self, f"{role}_resources").items():
                if not amount > 0 or name in ("CPU", "GPU", "memory"):
                    raise ValueError(f"pools.{role}_resources: {name} = {amount}: custom resources only, "
                                     "each > 0 (CPUs: cpus_per_worker)")
        return self

    def resources_for(self, role: str) -> dict[str, float]:
        """The custom Ray resources one worker of ``role`` asks for."""
        return dict(getattr(self, f"{role}_resources"))

    def options_for(self, role: str) -> PoolOptions:
        """The ``[pools.<role>]`` settings (defaults where the pool is a bare count)."""
        if role not in POOL_ROLES:
            raise ValueError(f"unknown pool role {role!r}; known: {', '.join(POOL_ROLES)}")
        return getattr(self, f"{role}_options")

    def replica_roles(self) -> list[str]:
        """One role per worker (a replica), in start order: the colocated pool, or prefill then decode."""
        if self.colocated:
            return ["colocated"] * self.colocated
        return ["prefill"] * self.prefill + ["decode"] * self.decode


class KVTransferSection(BaseModel):
    model_config = ConfigDict(extra="forbid")
    # A KV connector's name (workers.kv.connector), or auto: shared memory between workers on one
    # machine (CPU caches), collective otherwise.
    transport: str = "auto"
    timeout_s: float = Field(30.0, gt=0)
    verify_checksums: bool = Field(True, description="a CRC-32 per KV block travels with it; a decode "
                                   "worker re-places a request whose KV does not match instead of decoding it")

    @field_validator("transport")
    @classmethod
    def _known(cls, value: str) -> str:
        from baton_serve.workers.kv.connector import connector_order

        connector_order(value)  # ValueError listing the known connectors
        return value


class ServerSection(BaseModel):
    model_config = ConfigDict(extra="forbid")
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    max_queued_requests: int = Field(512, ge=1, description="reject with 429 beyond this many waiting")
    model_name: str | list[str] | None = Field(None, description="the served model name, or several "
                                               "(vLLM's --served-model-name): requests may use any, responses "
                                               "and metrics carry the first; default the model's own name")
    num_frontends: int = Field(1, ge=1, description="HTTP front replicas (Ray actors) sharing the port")
    api_key: str | None = Field(None, description="one key, one tenant (vLLM's --api-key); also BATON_API_KEY")
    tenants: str | None = Field(None, description="a tenants file (TOML): keys, rates, budgets, classes")
    max_body_bytes: int = Field(4 << 20, ge=1024, description="larger request bodies get 413")
    drain_timeout_s: float = Field(30.0, ge=0, description="on SIGTERM, how long open streams may finish")
    protect_metrics: bool = Field(False, description="/metrics needs an admin key (a tenant key without "
                                  "an [admin] table in the tenants file)")
    protect_probes: bool = Field(False, description="/health and /ready need an admin key too")
    idempotency_ttl_s: float = Field(3600.0, gt=0, description="how long a finished Idempotency-Key "
                                     "response is kept for retries")
    log_format: Literal["text", "json"] = Field("text", description="json: one object per line, "
                                                "each with the request id (X-Request-Id) it was written for")
    idempotency_grace_s: float = Field(5.0, ge=0, description="an idempotent run nobody listens to is "
                                       "aborted after this long")

    @field_validator("model_name")
    @classmethod
    def _names(cls, value: str | list[str] | None) -> str | list[str] | None:
        names = [value] if isinstance(value, str) else value or []
        if value is not None and (not names or any(not n.strip() for n in names)):
            raise ValueError("served model names must be non-empty strings")
        if len(set(names)) != len(names):
            raise ValueError(f"served model names repeat: {names}")
        return value

    def served_model_names(self, model_path: Path) -> list[str]:
        """The names the API answers to, the first being the one responses and metrics carry."""
        from baton_serve.router.serving import served_names
        from baton_serve.workers.checkpoint.default_model import served_name

        return served_names(served_name(model_path) if self.model_name is None else self.model_name)


class AdmissionSection(BaseModel):
    """Stage 2: KV reservations on the worker that keeps a request's cache (``cluster.admission.kv``)."""

    model_config = ConfigDict(extra="forbid")
    policy: str = Field("reserve", description="an admission policy's name: reserve, unlimited")
    reserve_fraction: float = Field(1.0, gt=0, le=1, description="share of max_tokens reserved up front; "
                                    "below 1, preemption is the safety net")
    queue_timeout_s: float = Field(30.0, gt=0, description="a request queued this long for KV room gets 429")
    max_queued_per_class: int = Field(256, ge=1, description="queued requests per priority class")

    @field_validator("policy")
    @classmethod
    def _known(cls, value: str) -> str:
        from baton_serve.cluster.admission.kv import admission_policies

        return _one_of(value, admission_policies(), "admission policy")


class UsageSection(BaseModel):
    """Where the usage records go (``cluster.usage``)."""

    model_config = ConfigDict(extra="forbid")
    store: str = Field("sqlite", description="a usage store's name")
    path: str | None = Field(None, description="sqlite: the database file (default: usage.sqlite3 in "
                             "the Baton cache folder)")

    @field_validator("store")
    @classmethod
    def _known(cls, value: str) -> str:
        from baton_serve.cluster.usage import usage_store_names

        return _one_of(value, usage_store_names(), "usage store")


class RouterSection(BaseModel):
    """How the fronts pick workers (``router.routing``) and keep their prefix index."""

    model_config = ConfigDict(extra="forbid")
    policy: str = Field("cost", description="a routing policy's name: cost, prefix, least_loaded, round_robin")
    conditional_disaggregation: bool = Field(
        True, description="cost: prefill a short uncached prompt on its decode worker when shipping "
        "its KV would cost more than it saves")
    stall_weight: float = Field(1.0, ge=0, description="cost: weight of the delay a prefill inflicts on "
                                "the sequences decoding on the same worker")
    work_weight: float = Field(1.0, ge=0, description="cost: weight of the delay a prefill's uncached "
                               "tokens inflict on the requests that queue behind it")
    share_weight: float = Field(1.0, ge=0, description="cost: weight of the core time a request adds on cores "
                                "workers share, taken from the other workers' requests there (0: price "
                                "every worker as if its cores were its own)")
    placement_tolerance: float = Field(0.25, ge=0, description="cost: a prompt no worker holds goes to the "
                                       "roomiest cache among candidates this close to the best (0: the best)")
    step_fit: bool = Field(False, description="cost: price a step from a fit to the steps themselves (overhead, "
                           "per prompt token, per decoding sequence) where it has the term; false (default): "
                           "from fits over stats intervals, which put a mixed step's overhead on its prompt tokens")
    pool_fits: bool = Field(True, description="cost: workers of one role on the same hardware share one fit of "
                            "their intervals (and steps); false: each worker is priced by its own fits")
    events_interval_s: float = Field(0.25, gt=0, description="how often fronts pull workers' KV events")
    index_ttl_s: float = Field(10.0, gt=0, description="a worker without KV events this long is stale: "
                               "its index entries expire")
    decision_log: str | None = Field(None, description="a JSON-lines file every front appends each routing "
                                     "decision to (every candidate's load and rate fits, every option's price "
                                     "under cost) and each request's measured TTFT: for studying a policy")

    @field_validator("policy")
    @classmethod
    def _known(cls, value: str) -> str:
        from baton_serve.router.routing import policy_names

        return _one_of(value, policy_names(), "routing policy")

    def make_policy(self, seed: int | None = None) -> Any:
        """The configured policy object (its options from this section where it takes them);
        ``seed`` fixes its random tie-breaks."""
        from baton_serve.router.routing import make_policy

        if self.policy == "cost":
            return make_policy("cost", seed, stall_weight=self.stall_weight, work_weight=self.work_weight,
                               share_weight=self.share_weight, placement_tolerance=self.placement_tolerance,
                               conditional_disaggregation=self.conditional_disaggregation, step_fit=self.step_fit,
                               pool_fits=self.pool_fits)
        return make_policy(self.policy, seed)


class RecoverySection(BaseModel):
    """What happens to requests when a worker dies (``cluster.front``)."""

    model_config = ConfigDict(extra="forbid")
    max_migrations: int = Field(3, ge=0, description="times a request may move to another worker after the "
                                "one holding it died (0: it fails with the worker)")
    migration_wait_s: float = Field(30.0, ge=0, description="how long a request whose worker died waits for "
                                    "a live one (a restart) before it fails with 503")
    restart_workers: bool = Field(True, description="the controller starts a dead worker again")
    max_restarts: int = Field(5, ge=0, description="restarts of one worker within restart_window_s; one "
                              "more death quarantines it")
    restart_window_s: float = Field(600.0, gt=0)
    restart_backoff_s: float = Field(1.0, ge=0, description="delay before the first restart; doubled "
                                     "for each further death within the window")
    restart_max_backoff_s: float = Field(30.0, ge=0)

    def restart_policy(self) -> Any:
        from baton_serve.cluster.restarts import RestartPolicy

        return RestartPolicy(self.restart_workers, self.max_restarts, self.restart_window_s,
                             self.restart_backoff_s, self.restart_max_backoff_s)


class RebalanceSection(BaseModel):
    """The controller's pool rebalancing (``cluster.rebalance``): when a pool is short and the other
    has room, a worker of the other changes role. The controller runs it live and ``baton plan
    sim`` on the virtual clock; every flip (``GlobalController.flip``, the rebalancer's or one
    asked for) follows ``drain_grace_s`` and ``drain_timeout_s``."""

    model_config = ConfigDict(extra="forbid")
    enabled: bool = False
    dry_run: bool = Field(False, description="decide and log, change nothing")
    interval_s: float = Field(10.0, gt=0, description="seconds between decisions")
    window_s: float = Field(60.0, gt=0, description="the signals' sliding window")
    cooldown_s: float = Field(60.0, ge=0, description="no decision acts this soon after an action")
    min_dwell_s: float = Field(120.0, ge=0, description="a worker keeps a role at least this long")
    max_actions_per_window: int = Field(1, ge=0)
    min_requests: int = Field(20, ge=0, description="finished requests the window needs before acting")
    enter: float = Field(1.0, gt=0, description="pressure above which a pool is short")
    slack: float = Field(0.7, gt=0, description="a pool gives up a worker only if it stays below this "
                         "pressure with one fewer")
    step_fraction: float = Field(0.25, gt=0, le=1, description="the most workers one decision flips, as a "
                                 "share of both pools (at least one)")
    ttft_target_s: float = Field(2.0, gt=0, description="the prefill pool's SLO")
    tpot_target_s: float = Field(0.1, gt=0, description="the decode pool's SLO")
    attainment: float = Field(0.9, gt=0, le=1, description="share of requests that must meet each SLO")
    utilization: float = Field(0.8, gt=0, le=1, description="busy fraction a pool may average")
    kv_high: float = Field(0.9, gt=0, le=1, description="KV usage above which the decode pool is short")
    min_prefill: int = Field(1, ge=1)
    min_decode: int = Field(1, ge=1)
    max_prefill: int | None = Field(None, ge=1)
    max_decode: int | None = Field(None, ge=1)
    drain_grace_s: float | None = Field(None, ge=0, description="a drained worker changes role no sooner "
                                        "than this after its drain began (fronts route on their last view); "
                                        "None: three controller intervals, at least 2 s")
    drain_timeout_s: float = Field(600.0, gt=0, description="a flip whose worker has not drained by then "
                                   "is given up")

    @model_validator(mode="after")
    def _consistent(self) -> RebalanceSection:
        if not self.slack < self.enter:
            raise ValueError(f"rebalance: slack ({self.slack}) must be below enter ({self.enter})")
        for role in ("prefill", "decode"):
            hi, lo = getattr(self, f"max_{role}"), getattr(self, f"min_{role}")
            if hi is not None and hi < lo:
                raise ValueError(f"rebalance: max_{role} ({hi}) is below min_{role} ({lo})")
        return self

    def policy(self) -> Any:
        from baton_serve.cluster.rebalance.decide import RebalancePolicy

        return RebalancePolicy(window_s=self.window_s, cooldown_s=self.cooldown_s, min_dwell_s=self.min_dwell_s,
                               max_actions_per_window=self.max_actions_per_window, min_requests=self.min_requests,
                               enter=self.enter, slack=self.slack, step_fraction=self.step_fraction,
                               min_workers={"prefill": self.min_prefill, "decode": self.min_decode},
                               max_workers={"prefill": self.max_prefill, "decode": self.max_decode})

    def targets(self) -> Any:
        from baton_serve.cluster.rebalance.signals import Targets

        return Targets(ttft_s=self.ttft_target_s, tpot_s=self.tpot_target_s, attainment=self.attainment,
                       utilization=self.utilization, kv_high=self.kv_high)


class RaySection(BaseModel):
    model_config = ConfigDict(extra="forbid")
    address: str | None = None  # None: start a local Ray instance; "auto": join a cluster
    num_cpus: int | None = None
    namespace: str = Field("baton", min_length=1, description="the Ray namespace of the deployment's named "
                           "actors (prefill-0, decode-0, colocated-0, controller, front-0, ...)")


class ClusterConfig(BaseModel):
    """The whole file: ``[engine]``, ``[pools]``, ``[kv_transfer]``, ``[server]``, ``[router]``,
    ``[admission]``, ``[usage]``, ``[recovery]``, ``[rebalance]``, ``[ray]``."""

    model_config = ConfigDict(extra="forbid")
    engine: EngineSection = EngineSection()
    pools: PoolsSection = PoolsSection()
    kv_transfer: KVTransferSection = KVTransferSection()
    server: ServerSection = ServerSection()
    router: RouterSection = RouterSection()
    admission: AdmissionSection = AdmissionSection()
    usage: UsageSection = UsageSection()
    recovery: RecoverySection = RecoverySection()
    rebalance: RebalanceSection = RebalanceSection()
    ray: RaySection = RaySection()

    @property
    def colocated(self) -> bool:
        return self.pools.colocated > 0

    def with_overrides(self, **overrides: Any) -> ClusterConfig:
        """Apply dotted overrides like ``{"pools.prefill": 2}`` or
        ``{"pools.prefill_options.tensor_parallel_size": 2}``; None values are ignored."""
        data = self.model_dump()
        for key, value in overrides.items():
            if value is None:
                continue
            *path, field = key.split(".")
            table = data
            for part in path:
                table = table[part]
            table[field] = value
        try:
            return ClusterConfig.model_validate(data)
        except ValidationError as exc:
            raise ConfigError(describe_error(exc)) from None


def describe_error(exc: ValidationError) -> str:
    """``field.path: message`` for the first error, the path spelt as in the file: a pool's
    ``<role>_options`` is its ``[pools.<role>]`` table."""
    first = exc.errors()[0]
    parts = [str(x) for x in first["loc"]]
    msg = first["msg"]
    if len(parts) > 2 and parts[0] == "pools" and parts[1].removesuffix("_options") in POOL_ROLES:
        parts[1] = parts[1].removesuffix("_options")
        if first["type"] == "extra_forbidden":
            msg = f"unknown key; known: replicas, {', '.join(PoolOptions.model_fields)}"
    return f"{'.'.join(parts)}: {msg}"


def _one_of(value: str, names: list[str], what: str) -> str:
    """``value`` if it is a registered name; the ValueError lists the known ones."""
    if value not in names:
        raise ValueError(f"unknown {what} {value!r}; known: {', '.join(names)}")
    return value


class ConfigError(ValueError):
    """A config file is missing, unreadable or invalid; the message names the field."""


def load_config(path: str | Path | None) -> ClusterConfig:
    """Read and validate a TOML config; None gives the defaults (the embedded model, 1P + 1D)."""
    if path is None:
        return ClusterConfig()
    p = Path(path)
    try:
        raw = tomllib.loads(p.read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file {p} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{p}: not valid TOML: {exc}") from None
    try:
        return ClusterConfig.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(f"{p}: {describe_error(exc)}") from None
