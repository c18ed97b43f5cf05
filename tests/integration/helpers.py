"""Small HTTP helpers for the server's integration tests (plain httpx: these tests check the
server, not the sdk)."""

from __future__ import annotations

import os
import random
import time

import httpx

from server.launcher.process import free_port
from tests.prestart import BIND_ENV
from tests.server_process import ServerProcess

BLOCK = 128


class RouterProof(httpx.Auth):
    """Signs each request as the cluster's P/D router does (:mod:`server.common.cluster_auth`): what
    a test needs to send transfer params or a hold claim straight to an instance, as the
    router would (and what no client has)."""

    requires_request_body = True

    def __init__(self, secret: str) -> None:
        self.secret = secret.encode()

    def auth_flow(self, request: httpx.Request):
        from server.common.cluster_auth import ROUTER_PROOF_HEADER, sign

        request.headers[ROUTER_PROOF_HEADER] = sign(
            self.secret, request.method, request.url.path, request.content
        )
        yield request


def client(server, auth: httpx.Auth | None = None, headers: dict | None = None) -> httpx.Client:
    return httpx.Client(
        base_url=server.url,
        timeout=600.0,
        headers={**server.headers(), **(headers or {})},
        auth=auth,
    )


def create_session(server, **body) -> None:
    """POST ``/v1/kvbranch/sessions`` with this body; the session must be created (201)."""
    with client(server) as c:
        r = c.post("/v1/kvbranch/sessions", json=body)
    assert r.status_code == 201, r.text


def branch_info(server, session: str, branch: str = "main") -> dict:
    """GET one branch of a session; it must exist (200)."""
    with client(server) as c:
        r = c.get(f"/v1/kvbranch/sessions/{session}/branches/{branch}")
    assert r.status_code == 200, r.text
    return r.json()


def chat_body(server, messages, *, session=None, branch=None, max_tokens=12, **extra) -> dict:
    """A greedy chat completion's body for ``server``'s model; ``session`` and ``branch`` (if
    given) in the body's session id and vLLM's xargs."""
    body = {
        "model": server.model,
        "messages": messages,
        "temperature": 0,
        "max_tokens": max_tokens,
        **extra,
    }
    if session:
        body["session_id"] = session
    if branch:
        body["vllm_xargs"] = {"kvbranch_branch": branch}
    return body


def chat(server, messages, *, auth=None, **kw) -> dict:
    body = chat_body(server, messages, **kw)
    with client(server, auth) as c:
        r = c.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def live_sessions(server) -> float:
    """The server's live sessions, every tenant's (``kvbranch_sessions`` on ``/metrics``: the
    stats route shows a caller its own only)."""
    with client(server) as c:
        r = c.get("/metrics")
    assert r.status_code == 200, r.text
    for line in r.text.splitlines():
        if line.startswith("kvbranch_sessions "):
            return float(line.split()[1])
    raise AssertionError("no kvbranch_sessions on /metrics")


def text_of(response: dict) -> str:
    return response["choices"][0]["message"]["content"]


def reset_device_cache(server, wait_s: float = 10.0) -> None:
    """Drop vLLM's device prefix cache (not the host store): dev-mode route. vLLM refuses the
    reset while a block is in use (a held turn): retried for up to ``wait_s``."""
    _reset_prefix_cache(server, wait_s, external=False)


def empty_caches(server, wait_s: float) -> None:
    """Drop vLLM's device prefix cache *and* kvbranch's host store (``reset_external``), so that
    only a pull from another instance can bring a prefix back. vLLM refuses the reset while any
    block is in use, and a finished turn's blocks stay in use while the instance holds them for
    a pull (until pulled, or the hold's TTL ends): retried for up to ``wait_s``."""
    _reset_prefix_cache(server, wait_s, external=True)


def _reset_prefix_cache(server, wait_s: float, *, external: bool) -> None:
    params = {"reset_external": "true"} if external else None
    deadline = time.monotonic() + wait_s
    with client(server) as c:
        while True:
            if c.post("/reset_prefix_cache", params=params).json().get("success"):
                return
            if time.monotonic() > deadline:
                break
            time.sleep(0.2)
    what = "prefix cache and host store" if external else "device prefix cache"
    raise AssertionError(f"{getattr(server, 'name', 'the server')}'s {what} could not be reset")


def system_prompt(words: int = 450, seed: int = 0) -> str:
    rnd = random.Random(seed)
    vocab = [
        "agent",
        "tool",
        "branch",
        "cache",
        "result",
        "query",
        "plan",
        "step",
        "value",
        "check",
        "record",
        "index",
        "weather",
        "city",
        "price",
        "order",
        "status",
    ]
    return "You are a careful assistant. Context: " + " ".join(
        f"{rnd.choice(vocab)}{rnd.randint(0, 99)}" for _ in range(words)
    )


def two_messages(user: str, *, words: int, seed: int) -> list[dict]:
    """A system prompt (``system_prompt(words, seed)``) and one user message."""
    return [
        {"role": "system", "content": system_prompt(words=words, seed=seed)},
        {"role": "user", "content": user},
    ]


def filler(i: int, words: int = 300) -> list[dict]:
    rnd = random.Random(1000 + i)
    return [
        {
            "role": "user",
            "content": f"Document {i}: "
            + " ".join(str(rnd.randint(0, 10**6)) for _ in range(words))
            + " Summarize.",
        }
    ]


def size_args(kv_cache_gib: float, host_store_gib: float, max_model_len: int) -> list[str]:
    """A server's sizes: device KV cache, host store and model length."""
    return [
        "--kv-cache-gib",
        str(kv_cache_gib),
        "--host-store-gib",
        str(host_store_gib),
        "--max-model-len",
        str(max_model_len),
    ]


def llm_kwargs(server) -> dict:
    """Keyword arguments for an integration LLM (``KVBranchLLM``, ``ChatKVBranch``), greedy."""
    return {
        "base_url": server.url,
        "api_key": server.api_key,
        "model": server.model,
        "temperature": 0,
        "timeout": 300,
    }


def stats(server) -> dict:
    """``GET /v1/kvbranch/stats`` of a kvbranch instance (200 required)."""
    with client(server) as c:
        r = c.get("/v1/kvbranch/stats")
    assert r.status_code == 200, r.text
    return r.json()


def pd_activity(server) -> dict:
    """What a refused request must leave as it was on a P or D instance: the engine requests
    and pulled tokens the connector counted, and the P/D side's holds placed, claims (refused
    too) and declined handles. Holds are counted as placed, not as alive: a hold whose lease
    ends while a probe runs is no work the probe caused."""
    counted = stats(server)
    pd = counted.get("pd") or {}
    return {
        "requests": counted["requests"],
        "remote_tokens": counted["hits_tokens"]["remote"],
        "declined": dict(pd.get("handles_declined") or {}),
        "holds_placed": pd.get("holds_placed"),
        "claims": pd.get("claims"),
        "claims_refused": pd.get("claims_refused"),
    }


def pd_instance(
    args: list[str],
    role: str,
    core: str,
    *,
    name: str,
    env: dict[str, str] | None = None,
) -> ServerProcess:
    """A prefill or decode instance with ``args``, pinned to ``core`` — or to the cores of the
    test lane it starts in (``VLLM_CPU_OMP_THREADS_BIND``, set by tests/prestart.py while another
    lane runs) — on a NIXL port of its own (not started): how every P/D fixture builds its
    instances."""
    core = os.environ.get(BIND_ENV) or core
    return ServerProcess(
        [*args, "--role", role, "--cpu-cores", core, "--nixl-port", str(free_port())],
        name=name,
        ready_timeout=900,
        env=env,
    )
