"""The ``[router]`` section: a policy chosen by name, in the file or on the command line."""

from __future__ import annotations

import pytest
from baton_serve.cluster.cli import build_parser
from baton_serve.cluster.config import ConfigError, load_config


def test_the_default_policy_is_cost_with_conditional_disaggregation() -> None:
    config = load_config(None)
    assert config.router.policy == "cost" and config.router.conditional_disaggregation
    policy = config.router.make_policy()
    assert policy.name == "cost" and policy.conditional_disaggregation
    assert policy.model.pool_fits and not policy.model.step_fit


def test_a_policy_named_in_the_file_is_made_with_its_options(tmp_path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('[router]\npolicy = "cost"\nconditional_disaggregation = false\nstall_weight = 0.5\n'
                    'pool_fits = false\n')
    policy = load_config(path).router.make_policy()
    assert not policy.conditional_disaggregation and policy.model.stall_weight == 0.5
    assert not policy.model.pool_fits
    path.write_text('[router]\npolicy = "prefix"\n')
    assert load_config(path).router.make_policy().name == "prefix"


def test_an_unknown_policy_fails_at_start_listing_the_known_ones(tmp_path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('[router]\npolicy = "fastest"\n')
    with pytest.raises(ConfigError, match="router.policy: .*known: cost, least_loaded, prefix, round_robin"):
        load_config(path)
    with pytest.raises(ValueError, match="known: cost, least_loaded, prefix, round_robin"):
        load_config(None).with_overrides(**{"router.policy": "fastest"})


def test_serve_takes_the_policy_on_the_command_line() -> None:
    args = build_parser().parse_args(["serve", "--routing-policy", "least_loaded"])
    assert args.routing_policy == "least_loaded"
    assert load_config(None).with_overrides(**{"router.policy": args.routing_policy}).router.policy == "least_loaded"


def test_serve_takes_the_kv_cache_size_on_the_command_line(capsys) -> None:
    args = build_parser().parse_args(["serve", "--kv-cache-memory-gib", "2.5"])
    config = load_config(None).with_overrides(**{"engine.kv_cache_memory_gib": args.kv_cache_memory_gib})
    assert config.engine.kv_cache_memory_gib == 2.5
    assert build_parser().parse_args(["serve"]).kv_cache_memory_gib is None  # the config's own (1 GiB)
    for bad in ("0", "-1", "nan", "inf", "lots"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", "--kv-cache-memory-gib", bad])
        assert "must be a positive number of GiB" in capsys.readouterr().err


def test_admission_usage_and_server_defaults() -> None:
    c = load_config(None)
    assert (c.admission.policy, c.admission.reserve_fraction, c.admission.queue_timeout_s) == ("reserve", 1.0, 30.0)
    assert c.usage.store == "sqlite" and c.engine.scheduling_policy == "fair"
    assert c.server.api_key is None and c.server.tenants is None and c.server.drain_timeout_s == 30.0


def test_unknown_admission_policy_or_usage_store_fails_naming_the_known(tmp_path) -> None:
    for text, known in (('[admission]\npolicy = "lottery"\n', "reserve, unlimited"),
                        ('[usage]\nstore = "kafka"\n', "sqlite")):
        cfg = tmp_path / "c.toml"
        cfg.write_text(text)
        with pytest.raises(ConfigError, match=known):
            load_config(cfg)


def test_serve_takes_the_api_key_and_tenants_on_the_command_line() -> None:
    args = build_parser().parse_args(["serve", "--api-key", "sk-1", "--tenants", "t.toml"])
    assert args.api_key == "sk-1" and args.tenants == "t.toml"
