"""Where a tensor-parallel replica runs: one Ray placement group per replica, bundle ``r`` for
rank ``r`` (bundle 0 holds the Worker actor, ``workers.parallel.executor.RayRanks`` the rest).

The bundle shapes and the messages are pure functions; ``reserve`` and ``release`` talk to Ray.
"""

from __future__ import annotations

import contextlib
from typing import Any

from baton_serve.cluster.config import ClusterConfig, ConfigError
from baton_serve.workers.model.config import ModelConfig


class PlacementError(ConfigError):
    """A pool's replica does not fit the cluster; the message names the field and what it has."""


def rank_bundles(tp: int, cpus: float, gpu: bool, resources: dict[str, float]) -> list[dict[str, float]]:
    """``tp`` equal bundles, one per rank: ``cpus`` (at least 1, what a rank actor asks without a
    thread count), one whole GPU each on CUDA (NCCL wants a device per rank), and the pool's custom
    resources in each, so that every rank lands on the nodes the pool is pinned to."""
    bundle = {"CPU": max(float(cpus), 1.0)}
    if gpu:
        bundle["GPU"] = 1.0
    bundle.update(resources)
    return [dict(bundle) for _ in range(tp)]


def _amounts(resources: dict[str, float], names: list[str]) -> str:
    return ", ".join(f"{name} {resources.get(name, 0.0):g}" for name in names)


def unplaced_message(role: str, tp: int, bundles: list[dict[str, float]], strategy: str, timeout_s: float,
                     total: dict[str, float], available: dict[str, float]) -> str:
    """Why start failed: the field, the bundles asked for, and the cluster's resources of those kinds."""
    names = sorted({name for b in bundles for name in b})
    return (f"pools.{role}.tensor_parallel_size = {tp}: a replica needs a placement group of {len(bundles)} "
            f"bundles ({_amounts(bundles[0], names)} each, {strategy}) and Ray could not place it within "
            f"{timeout_s:g} s; the cluster has {_amounts(total, names)} ({_amounts(available, names)} free): "
            "lower tensor_parallel_size, threads or pools.cpus_per_worker, add nodes, or pick another "
            "placement_strategy")


def check_pool_sizes(config: ClusterConfig, model: ModelConfig) -> None:
    """Every pool that starts splits ``model`` evenly; ConfigError naming ``pools.<role>.tensor_parallel_size``
    and the sizes that work otherwise."""
    from baton_serve.workers.parallel.sizes import TensorParallelSizeError, check_tensor_parallel_size

    for role in dict.fromkeys(config.pools.replica_roles()):
        field = f"pools.{role}.tensor_parallel_size"
        try:
            check_tensor_parallel_size(model, config.pools.options_for(role).tensor_parallel_size, field)
        except TensorParallelSizeError as exc:
            raise ConfigError(str(exc)) from None
    if config.kv_transfer.transport == "object_store" and uses_tensor_parallel(config):
        raise ConfigError("kv_transfer.transport = 'object_store' moves one cache per worker; pools with "
                          "tensor_parallel_size > 1 ship rank to rank: use 'auto' or 'collective'")


def uses_tensor_parallel(config: ClusterConfig) -> bool:
    """Whether any pool that starts has replicas of more than one rank."""
    return any(config.pools.options_for(r).tensor_parallel_size > 1 for r in config.pools.replica_roles())


def model_config_here(config: ClusterConfig) -> ModelConfig | None:
    """The served model's config.json read on this machine; None where it is not here (on a
    cluster the folder may exist only on the workers' nodes, which then check it themselves)."""
    from baton_serve.workers.checkpoint.default_model import resolve_model
    from baton_serve.workers.errors import ModelLoadError

    try:
        return ModelConfig.from_folder(resolve_model(config.engine.model))
    except ModelLoadError:
        return None


def reserve(role: str, tp: int, bundles: list[dict[str, float]], strategy: str, timeout_s: float) -> Any:
    """A ready placement group for one replica; ``PlacementError`` (nothing left behind) when Ray
    cannot place it within ``timeout_s``. Blocks up to ``timeout_s``."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    group = placement_group(bundles, strategy=strategy)
    if not group.wait(timeout_seconds=timeout_s):
        remove_placement_group(group)
        raise PlacementError(unplaced_message(role, tp, bundles, strategy, timeout_s, ray.cluster_resources(),
                                              ray.available_resources()))
    return group


def in_bundle_zero(group: Any) -> Any:
    """The Worker's scheduling strategy: bundle 0 of its replica's group. Its own tasks are not
    captured: its ranks name their bundles themselves."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=0,
                                            placement_group_capture_child_tasks=False)


def release(groups: list[Any]) -> None:
    """Remove placement groups (once their actors are gone); already removed ones are skipped."""
    from ray.util.placement_group import remove_placement_group

    for group in groups:
        with contextlib.suppress(Exception):
            remove_placement_group(group)
