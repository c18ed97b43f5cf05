"""One tenant digest: the router scopes its index by the same id the instances give a key."""

from __future__ import annotations

from types import SimpleNamespace

from server.common.tenants import ANONYMOUS, bearer_key, scope_of, tenant_id
from server.plugin.tenancy import owner_of


def test_the_router_scope_is_the_instances_owner():
    args = SimpleNamespace(api_key=["key-a", "key-b"])
    for key in ("key-a", "key-b"):
        assert scope_of(f"Bearer {key}") == owner_of(f"Bearer {key}", args) == tenant_id(key)
    assert scope_of("bearer key-a") == owner_of("bearer key-a", args)  # scheme any case


def test_scopes_apart():
    assert scope_of(None) == scope_of("") == ANONYMOUS
    assert scope_of("Bearer a") != scope_of("Bearer b")
    assert scope_of("Basic abc") != scope_of("Basic abd")  # not a key: still apart
    assert scope_of("Basic abc").startswith("h_") and tenant_id("x").startswith("t_")
    assert "abc" not in scope_of("Basic abc") and "key" not in tenant_id("key")


def test_bearer_key_as_vllm_parses_it():
    assert bearer_key("Bearer k 1") == "k 1"
    assert bearer_key("Token k") is None and bearer_key(None) is None
