"""Per-pool settings (``[pools.<role>]`` tables, ``--<role>-tp``) and the placement decisions a
tensor-parallel replica gets, as pure functions: nothing here starts Ray."""

from __future__ import annotations

import pytest
from baton_serve.cluster import launcher
from baton_serve.cluster.cli import build_parser, main, serve_config
from baton_serve.cluster.config import ClusterConfig, ConfigError, PoolOptions, load_config
from baton_serve.cluster.placement_groups import (
    check_pool_sizes,
    rank_bundles,
    unplaced_message,
    uses_tensor_parallel,
)
from baton_serve.cluster.status_view import format_status
from baton_serve.workers.model.config import ModelConfig


@pytest.fixture(autouse=True)
def two_cpus(monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.setattr(launcher, "_usable_cpus", lambda: 2)


def _toml(tmp_path, text: str) -> ClusterConfig:
    path = tmp_path / "c.toml"
    path.write_text(text)
    return load_config(path)


def _config(pools: dict, engine: dict | None = None, **sections: dict) -> ClusterConfig:
    return ClusterConfig.model_validate({"engine": engine or {}, "pools": pools, **sections})


# --- parsing -------------------------------------------------------------------------------------

def test_a_count_still_works_and_every_pool_has_default_options(tmp_path):
    config = _toml(tmp_path, "[pools]\nprefill = 2\ndecode = 3\n")
    assert (config.pools.prefill, config.pools.decode, config.pools.colocated) == (2, 3, 0)
    assert config.pools.options_for("prefill") == PoolOptions()
    assert config.pools.options_for("decode").tensor_parallel_size == 1
    assert config.pools.options_for("prefill").placement_strategy == "STRICT_PACK"
    assert not uses_tensor_parallel(config)


def test_a_table_gives_the_count_to_readers_and_its_options_to_options_for(tmp_path):
    config = _toml(tmp_path, """
[pools]
decode = 1

[pools.prefill]
replicas = 2
tensor_parallel_size = 2
max_num_batched_tokens = 4096
max_num_seqs = 64
threads = 2
placement_strategy = "SPREAD"
""")
    assert config.pools.prefill == 2 and isinstance(config.pools.prefill, int)
    assert config.pools.options_for("prefill") == PoolOptions(
        tensor_parallel_size=2, max_num_batched_tokens=4096, max_num_seqs=64, threads=2, placement_strategy="SPREAD")
    assert config.pools.options_for("decode") == PoolOptions()
    assert config.pools.replica_roles() == ["prefill", "prefill", "decode"]
    assert uses_tensor_parallel(config)


def test_a_table_without_replicas_is_one_replica(tmp_path):
    config = _toml(tmp_path, "[pools.colocated]\ntensor_parallel_size = 2\n")
    assert config.pools.colocated == 1 and config.colocated
    assert config.pools.replica_roles() == ["colocated"]


def test_an_unknown_key_names_it_and_the_known_ones(tmp_path):
    with pytest.raises(ConfigError, match=r"pools\.prefill\.tp: unknown key; known: replicas, "
                       r"tensor_parallel_size, max_num_batched_tokens, max_num_seqs, threads, placement_strategy"):
        _toml(tmp_path, "[pools.prefill]\nreplicas = 1\ntp = 2\n")


@pytest.mark.parametrize("body, field", [
    ("tensor_parallel_size = 0", "pools.decode.tensor_parallel_size"),
    ("max_num_seqs = 0", "pools.decode.max_num_seqs"),
    ("threads = 0", "pools.decode.threads"),
    ('placement_strategy = "ANYWHERE"', "pools.decode.placement_strategy"),
    ("replicas = -1", "pools.decode"),
])
def test_a_bad_value_names_the_field_as_the_file_spells_it(tmp_path, body, field):
    with pytest.raises(ConfigError, match=rf"c\.toml: {field}: "):
        _toml(tmp_path, f"[pools.decode]\n{body}\n")


def test_options_in_a_table_and_in_role_options_at_once_are_refused():
    with pytest.raises(ValueError, match="not both"):
        _config({"prefill": {"replicas": 1}, "prefill_options": {"tensor_parallel_size": 2}})


def test_overrides_keep_the_tables_and_reach_into_them():
    config = _config({"prefill": {"replicas": 2, "tensor_parallel_size": 2, "max_num_seqs": 8}})
    moved = config.with_overrides(**{"pools.prefill": 3, "pools.decode_options.tensor_parallel_size": 4})
    assert moved.pools.prefill == 3 and moved.pools.options_for("prefill").max_num_seqs == 8
    assert moved.pools.options_for("decode").tensor_parallel_size == 4
    with pytest.raises(ConfigError, match=r"^pools\.prefill\.tensor_parallel_size: .*greater than or equal to 1"):
        config.with_overrides(**{"pools.prefill_options.tensor_parallel_size": 0})
    with pytest.raises(ValueError, match="unknown pool role"):
        config.pools.options_for("router")


# --- the command line ----------------------------------------------------------------------------

def test_serve_takes_each_pools_tensor_parallel_size():
    config = serve_config(build_parser().parse_args(["serve", "--prefill-tp", "2", "--decode-tp", "4"]))
    assert config.pools.options_for("prefill").tensor_parallel_size == 2
    assert config.pools.options_for("decode").tensor_parallel_size == 4
    colocated = serve_config(build_parser().parse_args(["serve", "--colocated", "2", "--colocated-tp", "2"]))
    assert colocated.pools.colocated == 2 and colocated.pools.options_for("colocated").tensor_parallel_size == 2
    plain = serve_config(build_parser().parse_args(["serve"]))
    assert not uses_tensor_parallel(plain)


def test_a_flag_for_a_pool_that_does_not_start_is_one_line_and_status_2(capsys):
    assert main(["serve", "--colocated-tp", "2"]) == 2
    assert "--colocated-tp: this deployment starts no colocated workers" in capsys.readouterr().err
    assert main(["serve", "--colocated", "1", "--prefill-tp", "2"]) == 2
    assert "replaces the prefill and decode pools" in capsys.readouterr().err
    assert main(["serve", "--decode-tp", "0"]) == 2
    assert "pools.decode.tensor_parallel_size" in capsys.readouterr().err


# --- the model's sizes ---------------------------------------------------------------------------

def _smollm2_135m() -> ModelConfig:
    return ModelConfig.from_dict({"architectures": ["LlamaForCausalLM"], "vocab_size": 49152, "hidden_size": 576,
                                  "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
                                  "num_key_value_heads": 3})


def test_a_size_the_model_cannot_split_into_names_the_field_and_the_sizes_that_work(tiny_model_dir):
    tiny = ModelConfig.from_folder(tiny_model_dir)  # 4 query heads, 2 KV heads
    check_pool_sizes(_config({"colocated": {"tensor_parallel_size": 4}}), tiny)
    with pytest.raises(ConfigError, match=r"pools\.colocated\.tensor_parallel_size = 3 does not fit .*"
                       r"sizes that work: 1, 2, 4"):
        check_pool_sizes(_config({"colocated": {"tensor_parallel_size": 3}}), tiny)
    with pytest.raises(ConfigError, match=r"pools\.decode\.tensor_parallel_size = 2 .*sizes that work: 1, 3$"):
        check_pool_sizes(_config({"prefill": {"tensor_parallel_size": 3}, "decode": {"tensor_parallel_size": 2}}),
                         _smollm2_135m())
    # a pool that does not start is not checked: colocated replaces prefill and decode
    check_pool_sizes(_config({"colocated": 1, "prefill": {"tensor_parallel_size": 2}}), _smollm2_135m())


def test_tensor_parallel_pools_refuse_the_object_store_transport(tiny_model_dir):
    config = _config({"colocated": {"tensor_parallel_size": 2}}, kv_transfer={"transport": "object_store"})
    with pytest.raises(ConfigError, match="kv_transfer.transport = 'object_store'"):
        check_pool_sizes(config, ModelConfig.from_folder(tiny_model_dir))


# --- threads, bundles and options ----------------------------------------------------------------

def test_a_replicas_ranks_split_the_cores_unless_the_pool_says_otherwise():
    assert launcher.worker_threads(_config({"colocated": {"tensor_parallel_size": 2}}), "colocated") == 1
    assert launcher.worker_threads(_config({"colocated": 1}), "colocated") == 2
    assert launcher.worker_threads(_config({"colocated": {"threads": 3}}), "colocated") == 3
    assert launcher.worker_threads(_config({"colocated": {"threads": 3}}, {"threads_per_worker": 1}),
                                   "colocated") == 3  # the pool's own wins
    assert launcher.worker_threads(_config({"colocated": {"tensor_parallel_size": 2}, "cpus_per_worker": 4}),
                                   "colocated") == 4
    assert launcher.worker_threads(_config({"colocated": 1}, {"threads_per_worker": 1}), "colocated") == 1


def test_rank_bundles_cover_each_ranks_ask():
    assert rank_bundles(2, 0.0, False, {}) == [{"CPU": 1.0}, {"CPU": 1.0}]  # a rank actor asks 1 CPU at least
    assert rank_bundles(3, 4.0, True, {"node_a": 0.01}) == [{"CPU": 4.0, "GPU": 1.0, "node_a": 0.01}] * 3


def test_a_replicas_bundles_follow_its_pool():
    assert launcher.replica_bundles(_config({"colocated": {"tensor_parallel_size": 2, "threads": 1}}),
                                    "colocated") == [{"CPU": 1.0}] * 2
    config = _config({"prefill": {"tensor_parallel_size": 2, "threads": 2}, "decode": {"tensor_parallel_size": 4},
                      "cpus_per_worker": 1, "decode_resources": {"node_b": 0.01}})
    assert launcher.replica_bundles(config, "prefill") == [{"CPU": 2.0}] * 2  # threads beyond the reservation
    assert launcher.replica_bundles(config, "decode") == [{"CPU": 1.0, "node_b": 0.01}] * 4
    cuda = _config({"colocated": {"tensor_parallel_size": 2}}, {"device": "cuda"})
    assert launcher.replica_bundles(cuda, "colocated") == [{"CPU": 1.0, "GPU": 1.0}] * 2


def test_a_workers_engine_arguments_carry_its_pools_overrides_and_layout():
    config = _config({"prefill": {"tensor_parallel_size": 2, "max_num_seqs": 8, "max_num_batched_tokens": 4096},
                      "decode": 1}, {"max_num_seqs": 32})
    prefill = launcher.pool_engine_kwargs(config, "prefill", 1)
    assert (prefill["max_num_seqs"], prefill["max_num_batched_tokens"]) == (8, 4096)
    assert (prefill["tensor_parallel_size"], prefill["distributed_executor_backend"]) == (2, "ray")
    assert prefill["num_threads"] == 1  # what each rank runs, and asks Ray CPUs for
    decode = launcher.pool_engine_kwargs(config, "decode", 2)
    assert (decode["max_num_seqs"], decode["max_num_batched_tokens"]) == (32, 1024)
    assert "tensor_parallel_size" not in decode and "num_threads" not in decode


def test_a_replica_goes_in_bundle_zero_of_its_group_without_spread_or_resources():
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    config = _config({"colocated": {"tensor_parallel_size": 2}, "colocated_resources": {"node_a": 0.01}})
    group = object()  # what reserve() returns; the strategy only carries it
    options = launcher.actor_options(config, "colocated", group)
    strategy = options.pop("scheduling_strategy")
    assert isinstance(strategy, PlacementGroupSchedulingStrategy) and strategy.placement_group is group
    assert strategy.placement_group_bundle_index == 0 and not strategy.placement_group_capture_child_tasks
    assert options == {"num_cpus": 0.0}  # its custom resources are in the bundles
    assert launcher.actor_options(config, "colocated")["scheduling_strategy"] == "SPREAD"


def test_the_openmp_plan_counts_ranks_times_threads():
    assert launcher.openmp_plan(_config({"colocated": {"tensor_parallel_size": 2, "threads": 1}}))[0] == "spin"
    # 1 + 2 x 1 threads on 2 cores, one replica's threads unreserved: the board would not count rank 1
    mixed = _config({"prefill": {"threads": 1}, "decode": {"tensor_parallel_size": 2, "threads": 1}})
    assert launcher.openmp_plan(mixed)[0] == "passive"
    assert launcher.openmp_plan(_config({"prefill": {"threads": 1}, "decode": {"threads": 1}}))[0] == "spin"
    assert launcher.openmp_plan(_config({"prefill": {"threads": 2}, "decode": {"threads": 2}}))[0] == "share"


def test_the_unplaced_message_names_the_field_the_bundles_and_the_cluster():
    text = unplaced_message("decode", 4, [{"CPU": 1.0}] * 4, "STRICT_PACK", 60.0, {"CPU": 2.0, "memory": 1e9},
                            {"CPU": 0.0})
    assert text.startswith("pools.decode.tensor_parallel_size = 4: a replica needs a placement group of 4 bundles "
                           "(CPU 1 each, STRICT_PACK)")
    assert "within 60 s; the cluster has CPU 2 (CPU 0 free)" in text


def test_status_shows_each_replicas_tensor_parallel_size():
    row = {"worker_id": "colocated-0", "role": "colocated", "alive": True, "incarnation": 0, "restarts": 0,
           "restarting": False, "quarantined": False, "num_running": 1, "num_waiting": 0, "kv_cache_usage": 0.5,
           "tensor_parallel_size": 2}
    lines = format_status({"ready": True, "front_id": "f", "workers": [row], "migrations_total": 0,
                           "open_streams": 0, "controller": None}).splitlines()
    assert lines[0].split()[:4] == ["worker", "role", "tp", "state"]
    assert lines[1].split() == ["colocated-0", "colocated", "2", "alive", "0", "0", "1", "0", "50%"]
