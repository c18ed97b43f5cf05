"""Property-based fuzzing (hypothesis) of the router's doors with fake instances that answer as
vLLM would: whatever a client sends — any JSON value in the fields the router reads, any bytes
in the headers it reads or forwards, any body — the router answers a 2xx or a 4xx with a JSON
error, never a 5xx, and a request it refuses reaches no instance. (The same doors against the
real cluster: tests/integration/test_router_edge.py.)"""

from __future__ import annotations

import json

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sdk.contract import CHAT_COMPLETIONS_PATH, COMPLETIONS_PATH, SESSIONS_PATH
from tests.unit.server.router.fakes import Fakes, call, make_router

FUZZ = settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

json_leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False),
    st.text(max_size=40),
    st.sampled_from(["\ud800", "../x", "a" * 200, "s1", ""]),
)
json_value = st.recursive(
    json_leaf,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=8,
)
FIELDS = [
    "session_id",
    "stream",
    "max_tokens",
    "max_completion_tokens",
    "min_tokens",
    "n",
    "stream_options",
    "vllm_xargs",
    "prompt_cache_key",
    "kv_transfer_params",
    "messages",
    "prompt",
]
payloads = st.dictionaries(st.sampled_from(FIELDS), json_value, max_size=6)
header_bytes = st.binary(max_size=24)
headers = st.dictionaries(
    st.sampled_from(["authorization", "x-session-id", "x-kvbranch-branch", "content-type"]),
    header_bytes,
    max_size=3,
)


def vllm_like(request: httpx.Request) -> httpx.Response:
    """What P and D answer: P's leg its transfer params, D's a completion (streamed or not)."""
    body = json.loads(request.content)
    params = body.get("kv_transfer_params") or {}
    if params.get("do_remote_decode"):
        return httpx.Response(200, json={"kv_transfer_params": {"do_remote_prefill": True}})
    if body.get("stream") is True:
        return httpx.Response(
            200,
            content=b'data: {"choices": [{"delta": {"content": "x"}}]}\n\ndata: [DONE]\n\n',
            headers={"content-type": "text/event-stream"},
        )
    return httpx.Response(200, json={"choices": [{"message": {"content": "x"}}]})


def check(r: httpx.Response, fakes: Fakes) -> None:
    assert r.status_code < 500, (r.status_code, r.text)
    if r.status_code >= 400:
        assert r.json()["error"]["message"], r.text
        assert fakes.seen == [], "a refused request reached an instance"


@FUZZ
@given(
    payload=payloads, extra=headers, path=st.sampled_from([CHAT_COMPLETIONS_PATH, COMPLETIONS_PATH])
)
def test_a_turn_is_never_a_5xx(payload, extra, path):
    fakes = Fakes()
    fakes.answer["http://p.test:1"] = vllm_like
    fakes.answer["http://d.test:2"] = vllm_like
    router = make_router(fakes)
    body = json.dumps(payload).encode()  # lone surrogates as JSON escapes
    r = call(
        router,
        "POST",
        path,
        content=body,
        headers=httpx.Headers([(b"content-type", b"application/json"), *extra.items()]),
    )
    check(r, fakes)


@FUZZ
@given(payload=json_value, extra=headers)
def test_a_session_route_is_never_a_5xx(payload, extra):
    fakes = Fakes()
    fakes.answer["http://p.test:1"] = lambda r: httpx.Response(201, json={"session_id": "s"})
    fakes.answer["http://d.test:2"] = lambda r: httpx.Response(201, json={"session_id": "s"})
    r = call(
        make_router(fakes),
        "POST",
        SESSIONS_PATH,
        content=json.dumps(payload).encode(),
        headers=httpx.Headers([(b"content-type", b"application/json"), *extra.items()]),
    )
    check(r, fakes)


@FUZZ
@given(body=st.binary(max_size=200))
def test_any_bytes_as_a_body_are_never_a_5xx(body):
    fakes = Fakes()
    fakes.answer["http://p.test:1"] = vllm_like
    fakes.answer["http://d.test:2"] = vllm_like
    r = call(make_router(fakes), "POST", CHAT_COMPLETIONS_PATH, content=body)
    check(r, fakes)
