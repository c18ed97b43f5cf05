"""Issue 13 items 5-7 at the ASGI level (no server): every generating route of vLLM 0.32 is
salted per tenant, stripped of kvbranch's internal fields and guarded like chat; the tenant's
salt combines the client's ``cache_salt``; tenancy follows vLLM's own keys."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from sdk.contract import (
    BRANCH_XARG,
    COMPLETION_PATHS,
    GENERATE_PATHS,
    INTERNAL_XARGS,
    NESTED_XARGS_PATH,
    OWNER_XARG,
    PREFETCH_XARG,
    TAG_XARG,
    UNSALTABLE_PATHS,
    check_cache_salt,
)
from server.common.env import ENV_API_KEYS
from server.plugin import tenancy
from server.plugin.guard import KVBranchGuard
from server.plugin.middleware import KVBranchMiddleware, rewrite_request
from server.plugin.tenancy import owner_of, tenant_id, tenant_salt
from tests.unit.server.plugin.asgi import run_asgi

KEY_A, KEY_B = "key-a", "key-b"


@pytest.fixture
def keys(monkeypatch):
    monkeypatch.setenv(ENV_API_KEYS, f"{KEY_A},{KEY_B}")
    monkeypatch.delenv("VLLM_API_KEY", raising=False)


def test_vllm_0_32_generating_routes_are_all_covered():
    """Every POST route of the installed vLLM that reaches the engine's generate() is in
    GENERATE_PATHS or UNSALTABLE_PATHS (a vLLM upgrade that adds one fails here). The routes are
    written out again on purpose, not imported: a route dropped from the contract's table
    must fail here, so changing the table takes two edits."""
    expected = {
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/chat/completions/batch",
        "/v1/responses",
        "/v1/messages",
        "/inference/v1/generate",
        "/invocations",
        "/v1/systemone",
        "/generative_scoring",
    }
    assert set(GENERATE_PATHS) == expected
    assert set(COMPLETION_PATHS) <= set(GENERATE_PATHS)
    assert "/cohere/v2/chat" in UNSALTABLE_PATHS


# --- item 5: the salt ---------------------------------------------------------------------------
def test_client_salt_is_combined_with_the_tenant():
    a, b = tenant_id(KEY_A), tenant_id(KEY_B)
    out_a = rewrite_request({"cache_salt": "shared"}, tag="t", branch_header=None, owner=a)
    out_b = rewrite_request({"cache_salt": "shared"}, tag="t", branch_header=None, owner=b)
    assert out_a["cache_salt"] != out_b["cache_salt"]
    assert out_a["cache_salt"] != "shared" and out_a["cache_salt"].startswith(a)
    # a different client salt is a different cache within one tenant
    other = rewrite_request({"cache_salt": "other"}, tag="t", branch_header=None, owner=a)
    assert other["cache_salt"] != out_a["cache_salt"]
    # no client salt: the tenant's own; the combined salt is one vLLM accepts
    assert rewrite_request({}, tag="t", branch_header=None, owner=a)["cache_salt"] == a
    for salt in ("x", "y" * 128, "with spaces and ünïcode"):
        combined = tenant_salt(a, salt)
        check_cache_salt(combined)
        assert combined != tenant_salt(b, salt) and combined != tenant_salt(a, salt + "z")


def test_without_keys_the_client_salt_is_untouched():
    out = rewrite_request({"cache_salt": "mine"}, tag="t", branch_header=None, owner=None)
    assert out["cache_salt"] == "mine"


# --- item 6: every route ------------------------------------------------------------------------
def _body(path: str) -> dict:
    if path == NESTED_XARGS_PATH:
        return {
            "token_ids": [1, 2],
            "sampling_params": {
                "max_tokens": 1,
                "extra_args": {k: "forged" for k in INTERNAL_XARGS} | {"keep": 1},
            },
        }
    if path in ("/v1/systemone", "/generative_scoring"):
        return {"query": "q"}
    return {"messages": [], "vllm_xargs": {k: "forged" for k in INTERNAL_XARGS} | {"keep": 1}}


def _xargs(path: str, payload: dict) -> dict | None:
    if path == NESTED_XARGS_PATH:
        return payload["sampling_params"].get("extra_args")
    return payload.get("vllm_xargs")


@pytest.mark.parametrize("path", GENERATE_PATHS)
def test_every_route_is_salted_stripped_and_stamped(path):
    owner = tenant_id(KEY_A)
    out = rewrite_request(_body(path), tag="real", branch_header="feat", owner=owner, path=path)
    assert out["cache_salt"] == owner
    xargs = _xargs(path, out)
    if path in ("/v1/systemone", "/generative_scoring"):
        assert xargs is None  # no client extension fields there: nothing to strip or stamp
        return
    assert xargs[TAG_XARG] == "real" and xargs[OWNER_XARG] == owner
    assert PREFETCH_XARG not in xargs and xargs["keep"] == 1 and xargs[BRANCH_XARG] == "feat"


@pytest.mark.parametrize("path", GENERATE_PATHS)
def test_internal_fields_are_stripped_without_keys_too(path):
    out = rewrite_request(_body(path), tag="real", branch_header=None, owner=None, path=path)
    xargs = _xargs(path, out) or {}
    assert OWNER_XARG not in xargs and PREFETCH_XARG not in xargs
    assert xargs.get(TAG_XARG, "real") == "real"


# --- the ASGI stack: guard (outer) + middleware ---------------------------------------------------
class _App:
    def __init__(self) -> None:
        self.body: bytes | None = None

    async def __call__(self, scope, receive, send):
        self.body = b""
        while True:
            message = await receive()
            self.body += message.get("body", b"")
            if not message.get("more_body"):
                break
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"application/json")],
            }
        )
        await send({"type": "http.response.body", "body": b"{}"})


def _post(path: str, payload: dict, headers=(), app_args=None):
    inner = _App()
    stack = KVBranchGuard(KVBranchMiddleware(inner))
    body = json.dumps(payload).encode()
    scope = {
        "type": "http",
        "method": "POST",
        "path": path,
        "headers": [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
        ]
        + list(headers),
    }
    if app_args is not None:
        scope["app"] = SimpleNamespace(state=SimpleNamespace(args=app_args))
    sent = run_asgi(stack, scope, body)
    return sent.status, json.loads(sent.body), (json.loads(inner.body) if inner.body else None)


def _auth(key):
    return [(b"authorization", f"Bearer {key}".encode())]


@pytest.mark.parametrize("path", GENERATE_PATHS)
def test_generating_routes_need_a_valid_key(keys, path):
    for headers in ((), _auth("not-a-key"), [(b"authorization", b"Basic eHl6")]):
        status, reply, seen = _post(path, _body(path), headers)
        assert status == 401 and seen is None, (path, headers)
        assert "API key" in reply["error"]["message"]
    status, _, seen = _post(path, _body(path), _auth(KEY_B))
    assert status == 200 and seen["cache_salt"] == tenant_id(KEY_B)


def test_unsaltable_route_is_refused_with_keys(keys):
    status, reply, seen = _post("/cohere/v2/chat", {"messages": []}, _auth(KEY_A))
    assert status == 403 and seen is None
    assert "cache_salt" in reply["error"]["message"]


def test_unsaltable_route_passes_without_keys(monkeypatch):
    monkeypatch.delenv(ENV_API_KEYS, raising=False)
    status, _, seen = _post("/cohere/v2/chat", {"messages": []})
    assert status == 200 and seen == {"messages": []}


@pytest.mark.parametrize("path", GENERATE_PATHS)
def test_bad_ids_are_refused_on_every_route(keys, path):
    status, reply, seen = _post(path, _body(path), _auth(KEY_A) + [(b"x-session-id", b"../x")])
    assert status == 400 and seen is None and reply["error"]["param"] == "X-Session-ID"
    status, reply, _ = _post(path, _body(path), _auth(KEY_A) + [(b"x-kvbranch-branch", b"a b")])
    assert status == 400 and reply["error"]["param"] == "X-KVBranch-Branch"


@pytest.mark.parametrize("salt", ["", "a/b", "x" * 129, 5, ["s"]])
def test_bad_client_salt_is_refused_with_keys(keys, salt):
    """A salt vLLM would refuse must not become a valid one by being combined."""
    status, reply, seen = _post(
        "/v1/chat/completions", {"messages": [], "cache_salt": salt}, _auth(KEY_A)
    )
    assert status == 400 and seen is None and reply["error"]["param"] == "cache_salt"


def test_root_path_is_removed_before_matching(keys):
    inner = _App()
    stack = KVBranchGuard(KVBranchMiddleware(inner))
    scope = {
        "type": "http",
        "method": "POST",
        "path": "/api/invocations",
        "root_path": "/api",
        "headers": [],
    }
    sent: list[dict] = []
    queue = [{"type": "http.request", "body": b"{}", "more_body": False}]

    async def receive():
        return queue.pop(0)

    async def send(message):
        sent.append(message)

    asyncio.run(stack(scope, receive, send))
    assert sent[0]["status"] == 401 and inner.body is None


# --- item 7: tenancy follows the keys vLLM itself enforces -------------------------------------
def test_owner_only_for_a_configured_key(keys):
    assert owner_of(f"Bearer {KEY_A}") == tenant_id(KEY_A)
    assert owner_of(f"bearer {KEY_B}") == tenant_id(KEY_B)
    assert owner_of("Bearer someone-else") is None
    assert owner_of(f"Bearer  {KEY_A}") is None  # vLLM refuses it too (the space is the key's)
    assert owner_of(None) is None and owner_of("Basic abc") is None


def test_keys_come_from_vllm_args_then_vllm_api_key(monkeypatch):
    monkeypatch.delenv(ENV_API_KEYS, raising=False)
    monkeypatch.setenv("VLLM_API_KEY", "env-key")
    with_args = SimpleNamespace(api_key=["k1", "k2"])
    assert tenancy.keys_of(with_args) == ["k1", "k2"]  # vLLM: --api-key wins over the env
    assert tenancy.keys_of(SimpleNamespace(api_key=None)) == ["env-key"]
    monkeypatch.delenv("VLLM_API_KEY")
    assert tenancy.keys_of(SimpleNamespace(api_key=None)) == []


@pytest.mark.parametrize("api_key, env", [(["k1", "k2"], None), (None, "k1")])
def test_app_args_turn_tenancy_on_without_the_launcher(monkeypatch, api_key, env):
    """`vllm serve --api-key ...` (or VLLM_API_KEY) with the plugin, keys after `--`: the
    launcher's variable is not set, yet requests are owned and salted per key."""
    monkeypatch.delenv(ENV_API_KEYS, raising=False)
    if env:
        monkeypatch.setenv("VLLM_API_KEY", env)
    else:
        monkeypatch.delenv("VLLM_API_KEY", raising=False)
    args = SimpleNamespace(api_key=api_key)
    status, _, _ = _post("/invocations", {"messages": []}, (), app_args=args)
    assert status == 401
    status, _, seen = _post("/invocations", {"messages": []}, _auth("k1"), app_args=args)
    assert status == 200
    assert seen["vllm_xargs"][OWNER_XARG] == tenant_id("k1") == seen["cache_salt"]
