"""Tenants and keys: hashed keys in the file, 401s, cache namespaces per tenant."""

from __future__ import annotations

import pytest
from baton_serve.cluster.admission.tenants import (
    ANONYMOUS,
    AuthenticationError,
    TenantDirectory,
    hash_key,
    key_id,
)


def _write(tmp_path, text: str):
    p = tmp_path / "tenants.toml"
    p.write_text(text)
    return p


def test_open_server_is_one_anonymous_tenant_keeping_the_clients_salt():
    d = TenantDirectory.anonymous()
    ident = d.authenticate(None)
    assert d.open and ident.tenant.name == ANONYMOUS and ident.key_id is None
    assert ident.tenant.cache_salt(None) is None and ident.tenant.cache_salt("s") == "s"


def test_single_key_needs_the_key():
    d = TenantDirectory.single_key("sk-secret")
    assert d.authenticate("Bearer sk-secret").tenant.name == "default"
    assert d.authenticate(None, "sk-secret").tenant.name == "default"  # x-api-key
    with pytest.raises(AuthenticationError, match="didn't provide"):
        d.authenticate(None)
    with pytest.raises(AuthenticationError, match="Incorrect"):
        d.authenticate("Bearer sk-wrong")
    with pytest.raises(AuthenticationError):
        d.authenticate("Basic sk-secret")


def test_tenants_file_keys_are_digests_and_namespaces_are_per_tenant(tmp_path):
    p = _write(tmp_path, f"""
[tenants.acme]
api_keys = ["{hash_key('ka')}"]
priority = 1
requests_per_second = 5
[tenants.beta]
api_keys = ["{hash_key('kb1')}", "{hash_key('kb2')}"]
cache_namespace = "shared"
[tenants.gamma]
api_keys = ["{hash_key('kc')}"]
cache_namespace = "shared"
""")
    d = TenantDirectory.from_file(p)
    a = d.authenticate("Bearer ka")
    assert a.tenant.name == "acme" and a.tenant.priority == 1 and a.key_id == key_id(hash_key("ka"))
    assert d.authenticate("Bearer kb2").tenant.name == "beta"
    # Own namespace by default, so acme's salt differs from everyone's; beta and gamma opted to share.
    salts = {n: d.tenants[n].cache_salt(None) for n in ("acme", "beta", "gamma")}
    assert salts["acme"] == "acme" and salts["beta"] == salts["gamma"] == "shared"
    assert d.tenants["acme"].cache_salt("x") != d.tenants["beta"].cache_salt("x")
    assert "ka" not in p.read_text()  # the file holds digests only


def test_a_plain_key_in_the_file_is_refused_with_the_field(tmp_path):
    p = _write(tmp_path, '[tenants.acme]\napi_keys = ["sk-plain"]\n')
    with pytest.raises(ValueError, match=r"tenants\.acme\.api_keys.*digests"):
        TenantDirectory.from_file(p)


def test_unknown_field_and_shared_key_are_errors(tmp_path):
    with pytest.raises(ValueError, match="rate_limit"):
        TenantDirectory.from_file(_write(tmp_path, "[tenants.a]\nrate_limit = 3\n"))
    k = hash_key("same")
    with pytest.raises(ValueError, match="one key is given to tenants"):
        TenantDirectory.from_file(_write(tmp_path, f'[tenants.a]\napi_keys=["{k}"]\n[tenants.b]\napi_keys=["{k}"]\n'))
    with pytest.raises(ValueError, match="does not exist"):
        TenantDirectory.from_file(tmp_path / "missing.toml")


def test_admin_keys(tmp_path):
    p = _write(tmp_path, f'[tenants.a]\napi_keys=["{hash_key("ka")}"]\n[admin]\napi_keys=["{hash_key("root")}"]\n')
    d = TenantDirectory.from_file(p)
    assert d.is_admin("Bearer root") and not d.is_admin("Bearer ka") and not d.is_admin(None)
    with pytest.raises(AuthenticationError):
        d.authenticate("Bearer root")  # an admin key is not a tenant's
    # Without an [admin] table any tenant key reads the metrics.
    assert TenantDirectory.single_key("k").is_admin("Bearer k")


def test_the_example_tenants_file_loads_and_its_keys_work():
    from pathlib import Path

    d = TenantDirectory.from_file(Path(__file__).resolve().parents[3] / "deploy" / "tenants.example.toml")
    assert d.authenticate("Bearer sk-example-acme").tenant.name == "acme"
    assert d.authenticate("Bearer sk-example-beta").tenant.priority == 1
    assert d.is_admin("Bearer sk-example-admin")


def test_keys_hash_cli_prints_the_digest(capsys):
    from baton_serve.cluster.cli import main

    assert main(["keys", "hash", "sk-x"]) == 0
    assert capsys.readouterr().out.startswith(hash_key("sk-x") + "  # key-")
