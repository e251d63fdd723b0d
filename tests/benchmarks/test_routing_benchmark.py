"""benchmarks/routing.py: policy variants compared in one run are valid router settings."""

from __future__ import annotations

import pytest

from benchmarks.routing import _policy_specs, policy_config
from cluster.config import ClusterConfig


def test_a_policy_variant_becomes_router_settings_the_config_accepts() -> None:
    assert policy_config("prefix") == {"policy": "prefix"}
    variant = policy_config("cost:share_weight=0,conditional_disaggregation=false")
    assert variant == {"policy": "cost", "share_weight": 0, "conditional_disaggregation": False}
    policy = ClusterConfig.model_validate({"router": variant}).router.make_policy()
    assert policy.model.share_weight == 0 and not policy.conditional_disaggregation
    with pytest.raises(ValueError, match="not key=value"):
        policy_config("cost:share_weight")
    assert _policy_specs("prefix,cost") == ["prefix", "cost"]
    assert _policy_specs("prefix; cost:share_weight=0,stall_weight=2") == ["prefix", "cost:share_weight=0,stall_weight=2"]
