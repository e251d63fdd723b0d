"""The workers' OpenMP plan: spin where each worker thread has a core, share the cores where local
workers outnumber them, sleep on a cluster whose cores are unknown."""

from __future__ import annotations

import pytest

from cluster import launcher
from cluster.config import ClusterConfig

PASSIVE = ("passive", {"OMP_WAIT_POLICY": "PASSIVE"})
SPIN = ("spin", {})
SHARE = ("share", {})  # default spin; each worker ends its team when it hands the cores over


@pytest.fixture(autouse=True)
def two_cpus(monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.setattr(launcher, "_usable_cpus", lambda: 2)


def _plan(engine: dict, pools: dict, ray: dict | None = None) -> tuple[str, dict[str, str]]:
    config = ClusterConfig.model_validate({"engine": engine, "pools": pools, "ray": ray or {}})
    workers = config.pools.colocated or config.pools.prefill + config.pools.decode
    return launcher.openmp_plan(config, workers)


def test_one_colocated_worker_on_all_cores_spins():
    assert _plan({"threads_per_worker": 2}, {"colocated": 1}) == SPIN


def test_local_pools_sharing_cores_share_them():
    assert _plan({"threads_per_worker": 2}, {"prefill": 1, "decode": 1}) == SHARE


def test_pools_that_fit_the_cores_spin():
    assert _plan({"threads_per_worker": 1}, {"prefill": 1, "decode": 1}) == SPIN


def test_reserved_cpus_spin_even_on_a_remote_cluster():
    assert _plan({"threads_per_worker": 2}, {"prefill": 2, "decode": 2, "cpus_per_worker": 2},
                {"address": "auto"}) == SPIN
    assert _plan({"threads_per_worker": 2}, {"prefill": 1, "decode": 1, "cpus_per_worker": 1},
                {"address": "auto"}) == PASSIVE
    # a remote cluster's cores are unknown here: without a reservation, sleep
    assert _plan({"threads_per_worker": 1}, {"colocated": 1}, {"address": "auto"}) == PASSIVE


def test_an_explicit_setting_wins_over_auto():
    assert _plan({"threads_per_worker": 2, "openmp_wait": "spin"}, {"prefill": 1, "decode": 1}) == SPIN
    assert _plan({"threads_per_worker": 2, "openmp_wait": "passive"}, {"prefill": 1, "decode": 1}) == PASSIVE
    assert _plan({"threads_per_worker": 1, "openmp_wait": "passive"}, {"colocated": 1}) == PASSIVE


def test_the_users_omp_wait_policy_wins(monkeypatch):
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert _plan({"threads_per_worker": 2}, {"prefill": 1, "decode": 1}) == ("user", {"OMP_WAIT_POLICY": "ACTIVE"})


def test_sharing_workers_spin_briefly_only_where_their_team_cannot_be_ended(monkeypatch):
    assert launcher._torch_runtime_can_release()  # torch's wheel bundles libgomp, which can
    monkeypatch.setattr(launcher, "_torch_runtime_can_release", lambda: False)
    mode, env = _plan({"threads_per_worker": 2}, {"prefill": 1, "decode": 1})
    assert mode == "share" and int(env["GOMP_SPINCOUNT"]) < 300_000  # libgomp's default outlives the step


def test_the_users_spin_count_wins(monkeypatch):
    monkeypatch.setenv("GOMP_SPINCOUNT", "50000")
    assert _plan({"threads_per_worker": 2}, {"prefill": 1, "decode": 1}) == ("share", {"GOMP_SPINCOUNT": "50000"})


def test_an_unknown_policy_is_a_config_error():
    with pytest.raises(ValueError, match="openmp_wait"):
        ClusterConfig.model_validate({"engine": {"openmp_wait": "sometimes"}})
