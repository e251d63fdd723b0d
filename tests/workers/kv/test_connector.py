"""The KV connector registry (workers.kv.connector); each transport's data path is exercised
through real workers in tests/workers/actor/test_worker.py and tests/cluster/test_pools.py."""

from __future__ import annotations

import pytest
from baton_serve.workers.kv import connector as kvc


def test_the_three_transports_are_registered_and_auto_prefers_shared_memory():
    assert kvc.connector_names() == ["collective", "object_store", "shared_memory"]
    assert kvc.connector_order("auto") == ("shared_memory", "collective")
    assert kvc.connector_order("object_store") == ("object_store",)
    assert kvc.connector_class("shared_memory").needs_shared_cache
    assert not kvc.connector_class("collective").needs_shared_cache


def test_an_unknown_name_fails_listing_the_known_ones():
    with pytest.raises(ValueError, match="unknown KV connector 'nixl'; known: collective, object_store"):
        kvc.connector_order("nixl")


def test_a_new_connector_is_one_class_and_one_registration(monkeypatch):
    kvc.connector_names()  # the built-ins registered, then a scratch copy of the registry for this test
    monkeypatch.setattr(kvc._REGISTRY, "_classes", dict(kvc._REGISTRY._classes))

    @kvc.register_connector
    class Loopback(kvc.KVConnector):
        name = "loopback"

    assert kvc.connector_order("loopback") == ("loopback",)
    made = kvc.make_connector("loopback", host=object())
    assert isinstance(made, Loopback) and made.stats() == {} and made.reaches("decode-0", None)
    with pytest.raises(ValueError, match="empty or taken"):
        kvc.register_connector(Loopback)


def test_the_base_decode_side_takes_no_set_up_call():
    with pytest.raises(ValueError, match="takes no set-up call"):
        kvc.KVConnector(host=object()).accept("prefill-0", {})
