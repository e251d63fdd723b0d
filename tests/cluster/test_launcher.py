"""The workers' OpenMP plan: spin where each worker thread has a core, share the cores where local
workers outnumber them, sleep on a cluster whose cores are unknown."""

from __future__ import annotations

import pytest
from baton_serve.cluster import launcher
from baton_serve.cluster.config import ClusterConfig

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
    return launcher.openmp_plan(config)


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


# --- threads_per_worker = "auto" and dtype agreement --------------------------------------------

def _config(engine: dict | None = None, pools: dict | None = None, ray: dict | None = None) -> ClusterConfig:
    return ClusterConfig.model_validate({"engine": engine or {}, "pools": pools or {}, "ray": ray or {}})


def test_auto_threads_fill_the_cores_a_worker_is_given():
    assert launcher.worker_threads(_config()) == 2  # local: every core (the pools take turns at them)
    assert launcher.worker_threads(_config(pools={"colocated": 1})) == 2
    assert launcher.worker_threads(_config(pools={"cpus_per_worker": 4})) == 4  # reserved cores
    assert launcher.worker_threads(_config(pools={"cpus_per_worker": 1.5})) == 1
    assert launcher.worker_threads(_config(ray={"address": "auto"})) is None  # each worker's own machine
    assert launcher.worker_threads(_config({"threads_per_worker": 3})) == 3  # explicit wins


def test_auto_threads_plan_like_explicit_ones():
    """The default (auto) on 2 cores: 1P + 1D share the cores, one colocated worker spins, and a
    cluster without reservations sleeps at waits."""
    assert launcher.openmp_plan(_config()) == SHARE
    assert launcher.openmp_plan(_config(pools={"colocated": 1})) == SPIN
    assert launcher.openmp_plan(_config(ray={"address": "auto"})) == PASSIVE


def test_bad_thread_counts_are_config_errors():
    for bad in (0, -1, "many"):
        with pytest.raises(ValueError, match="threads_per_worker"):
            _config({"threads_per_worker": bad})


def test_the_defaults_are_the_same_however_the_server_is_started():
    """``make serve`` reads deploy/local.toml, ``baton serve`` without --config the built-in defaults."""
    from pathlib import Path

    from baton_serve.cluster.config import load_config

    local = load_config(Path(__file__).resolve().parents[2] / "deploy" / "local.toml")
    assert local.model_dump() == ClusterConfig().model_dump()
    assert local.engine.dtype == "auto" and local.engine.threads_per_worker == "auto"


def test_workers_that_resolved_different_dtypes_are_refused():
    from baton_serve.cluster.front.workers import WorkerRef

    same = [WorkerRef("prefill-0", "prefill", None, {"dtype": "float32"}),
            WorkerRef("decode-0", "decode", None, {"dtype": "float32"})]
    launcher.check_same_dtype(same)
    mixed = [same[0], WorkerRef("decode-0", "decode", None, {"dtype": "bfloat16"})]
    with pytest.raises(ValueError, match="set engine.dtype"):
        launcher.check_same_dtype(mixed)


def test_pools_are_pinned_by_their_custom_resources_and_spread_by_default():
    config = ClusterConfig.model_validate({"engine": {"device": "cpu"}, "pools": {
        "prefill": 1, "decode": 2, "cpus_per_worker": 2,
        "prefill_resources": {"node_a": 0.01}, "decode_resources": {"node_b": 0.01}}})
    assert launcher.actor_options(config, "prefill") == {
        "num_cpus": 2, "resources": {"node_a": 0.01}, "scheduling_strategy": "SPREAD"}
    assert launcher.actor_options(config, "decode")["resources"] == {"node_b": 0.01}
    packed = config.with_overrides(**{"pools.spread": False})
    assert launcher.actor_options(packed, "colocated") == {"num_cpus": 2}


@pytest.mark.parametrize("resources", [{"node_a": 0}, {"CPU": 1}, {"GPU": 1}])
def test_pool_resources_are_custom_and_positive(resources):
    with pytest.raises(ValueError, match="custom resources only"):
        ClusterConfig.model_validate({"pools": {"prefill_resources": resources}})


def test_workers_that_resolved_different_device_kinds_are_refused():
    from baton_serve.cluster.front.workers import WorkerRef

    gpus = [WorkerRef("prefill-0", "prefill", None, {"device": "cuda:0"}),
            WorkerRef("decode-0", "decode", None, {"device": "cuda:0"})]
    launcher.check_same_device_kind(gpus)  # one kind, whatever the index within each actor's GPUs
    mixed = [gpus[0], WorkerRef("decode-0", "decode", None, {"device": "cpu"})]
    with pytest.raises(ValueError, match="set engine.device"):
        launcher.check_same_device_kind(mixed)


@pytest.mark.parametrize(("engine", "pools", "gpus"), [
    ({"device": "cpu"}, {}, 0.0),
    ({"device": "cuda"}, {}, 1.0),
    ({"device": "cuda:0"}, {}, 1.0),
    ({"device": "cuda"}, {"gpus_per_worker": 0.5}, 0.5),  # fractions share a GPU
    ({"device": "cpu"}, {"gpus_per_worker": 2}, 2.0),  # as configured, whatever the device
])
def test_workers_ask_ray_for_gpus_by_device(engine, pools, gpus):
    config = ClusterConfig.model_validate({"engine": engine, "pools": pools})
    assert launcher.gpus_per_worker(config) == gpus
    options = launcher.actor_options(config, "prefill")
    assert options.get("num_gpus", 0.0) == gpus
    assert "num_gpus" in options or gpus == 0


def test_auto_device_asks_for_gpus_only_where_the_cluster_has_them(monkeypatch):
    import ray

    config = ClusterConfig.model_validate({})  # 1 prefill + 1 decode
    assert config.engine.device == "auto" and config.pools.gpus_per_worker == "auto"
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 16.0, "GPU": 8.0})
    assert launcher.gpus_per_worker(config) == 1.0
    assert launcher.gpu_memory_share(config) == config.engine.gpu_memory_utilization
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 2.0})
    assert launcher.gpus_per_worker(config) == 0.0
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    assert launcher.gpus_per_worker(config) == 0.0


def test_workers_outnumbering_the_gpus_share_them_and_their_memory(monkeypatch):
    import ray

    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 16.0, "GPU": 1.0})
    two = ClusterConfig.model_validate({"engine": {"gpu_memory_utilization": 0.8}})
    assert launcher.gpus_per_worker(two) == 0.5
    assert launcher.gpu_memory_share(two) == pytest.approx(0.4)
    three = ClusterConfig.model_validate({"pools": {"colocated": 3}})
    assert launcher.gpus_per_worker(three) == 0.33  # rounded down: three of them fit on one GPU
    fixed = two.with_overrides(**{"pools.gpus_per_worker": 1})
    assert launcher.gpus_per_worker(fixed) == 1.0 and launcher.gpu_memory_share(fixed) == 0.8


@pytest.mark.parametrize(("section", "values", "match"), [
    ("engine", {"device": "gpu"}, "device must be"),
    ("engine", {"device": "cuda:x"}, "device must be"),
    ("engine", {"gpu_memory_utilization": 0}, "gpu_memory_utilization"),
    ("engine", {"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
    ("pools", {"gpus_per_worker": -1}, "gpus_per_worker"),
])
def test_device_settings_are_checked(section, values, match):
    with pytest.raises(ValueError, match=match):
        ClusterConfig.model_validate({section: values})


def test_the_engine_section_reaches_workers_in_the_engine_s_own_names():
    from baton_serve.workers.engine.config import SchedulerConfig

    config = ClusterConfig.model_validate({"engine": {"long_prefill_token_threshold": 256,
                                                      "scheduling_policy": "fcfs"}})
    kwargs = launcher.worker_engine_kwargs(config)
    assert kwargs["max_prefill_chunk"] == 256 and kwargs["policy"] == "fcfs"
    assert not {"long_prefill_token_threshold", "scheduling_policy", "threads_per_worker"} & set(kwargs)
    # what a Worker passes on to its scheduler
    sched = SchedulerConfig(**{k: v for k, v in kwargs.items() if k in SchedulerConfig.__dataclass_fields__})
    assert sched.max_prefill_chunk == 256
    # unset, the scheduler's own default (no cap below the step's budget) stands
    assert "max_prefill_chunk" not in launcher.worker_engine_kwargs(ClusterConfig())
    with pytest.raises(ValueError, match="long_prefill_token_threshold"):
        ClusterConfig.model_validate({"engine": {"long_prefill_token_threshold": 0}})


def test_deterministic_reaches_the_engine_from_the_file_and_the_flag():
    from baton_serve.cluster.cli import build_parser
    from baton_serve.workers.engine.config import engine_config

    from_file = ClusterConfig.model_validate({"engine": {"deterministic": True}})
    assert engine_config(**launcher.worker_engine_kwargs(from_file)).deterministic
    assert not engine_config(**launcher.worker_engine_kwargs(ClusterConfig())).deterministic
    args = build_parser().parse_args(["serve", "--deterministic"])
    assert args.deterministic is True
    assert build_parser().parse_args(["serve"]).deterministic is None  # unset: the file's value stands
    assert ClusterConfig().with_overrides(**{"engine.deterministic": args.deterministic}).engine.deterministic
