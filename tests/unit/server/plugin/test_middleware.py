"""The completion middleware: request rewriting, and adding the split to JSON and SSE bodies."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any

import pytest

from sdk.contract import BRANCH_HEADER, RESPONSE_FIELD
from server.connector.control.models import ControlRequest, parse_answer
from server.connector.core.planner import BRANCH_XARG, OWNER_XARG, TAG_XARG
from server.plugin.middleware import KVBranchMiddleware, add_split_to_event, rewrite_request
from server.plugin.tenancy import ENV_API_KEYS, owner_of

SPLIT = {
    "session_id": "s",
    "branch_id": "main",
    "prompt_tokens": 10,
    "device_hit_tokens": 4,
    "host_hit_tokens": 4,
    "remote_hit_tokens": 0,
    "recomputed_tokens": 2,
}


# --- rewrite_request --------------------------------------------------------------------------
def test_rewrite_adds_tag_to_payload_without_xargs():
    out = rewrite_request({"model": "m"}, tag="t1", branch_header=None, owner=None)
    assert out == {"model": "m", "vllm_xargs": {TAG_XARG: "t1"}}


def test_rewrite_none_xargs_is_treated_as_empty():
    out = rewrite_request({"vllm_xargs": None}, tag="t1", branch_header=None, owner=None)
    assert out["vllm_xargs"] == {TAG_XARG: "t1"}


def test_rewrite_keeps_other_xargs():
    out = rewrite_request({"vllm_xargs": {"x": 1}}, tag="t", branch_header=None, owner=None)
    assert out["vllm_xargs"] == {"x": 1, TAG_XARG: "t"}


def test_branch_header_used_when_absent():
    out = rewrite_request({}, tag="t", branch_header="feature", owner=None)
    assert out["vllm_xargs"][BRANCH_XARG] == "feature"


def test_branch_header_does_not_override_body():
    out = rewrite_request(
        {"vllm_xargs": {BRANCH_XARG: "body"}}, tag="t", branch_header="header", owner=None
    )
    assert out["vllm_xargs"][BRANCH_XARG] == "body"


def test_empty_branch_header_ignored():
    out = rewrite_request({}, tag="t", branch_header="", owner=None)
    assert BRANCH_XARG not in out["vllm_xargs"]


def test_client_supplied_tag_and_owner_are_stripped():
    payload = {"vllm_xargs": {TAG_XARG: "forged", OWNER_XARG: "t_victim", "keep": "x"}}
    out = rewrite_request(payload, tag="real", branch_header=None, owner=None)
    assert out["vllm_xargs"] == {TAG_XARG: "real", "keep": "x"}
    payload = {"vllm_xargs": {OWNER_XARG: "t_victim"}}
    out = rewrite_request(payload, tag="real", branch_header=None, owner="t_me")
    assert out["vllm_xargs"][OWNER_XARG] == "t_me"


def test_owner_sets_cache_salt_and_combines_a_given_one():
    """Issue 13 item 5: a client salt no longer replaces the tenant's (two keys sending the
    same salt shared a cache); it is combined with it."""
    out = rewrite_request({}, tag="t", branch_header=None, owner="t_me")
    assert out["cache_salt"] == "t_me"
    assert out["vllm_xargs"][OWNER_XARG] == "t_me"
    out = rewrite_request({"cache_salt": "mine"}, tag="t", branch_header=None, owner="t_me")
    assert out["cache_salt"].startswith("t_me.") and out["cache_salt"] != "mine"
    out = rewrite_request({"cache_salt": ""}, tag="t", branch_header=None, owner="t_me")
    assert out["cache_salt"] == "t_me"


def test_no_owner_no_salt():
    out = rewrite_request({}, tag="t", branch_header=None, owner=None)
    assert "cache_salt" not in out
    assert OWNER_XARG not in out["vllm_xargs"]


@pytest.mark.parametrize("bad", ["str", ["a"], 3])
def test_non_dict_xargs_left_alone(bad):
    payload = {"vllm_xargs": bad, "model": "m"}
    out = rewrite_request(payload, tag="t", branch_header="b", owner=None)
    assert out == {"vllm_xargs": bad, "model": "m"}
    # vLLM refuses the body; the tenant salt is set all the same
    out = rewrite_request(dict(payload), tag="t", branch_header="b", owner="t_me")
    assert out == {"vllm_xargs": bad, "model": "m", "cache_salt": "t_me"}


# --- owner_of (used by the middleware) ---------------------------------------------------------
def test_owner_of(monkeypatch):
    monkeypatch.delenv(ENV_API_KEYS, raising=False)
    assert owner_of("Bearer k1") is None
    monkeypatch.setenv(ENV_API_KEYS, "k1,k2")
    a = owner_of("Bearer k1")
    assert a is not None and a.startswith("t_") and "k1" not in a
    assert owner_of("bearer k1") == a
    assert owner_of("Bearer k2") != a
    assert owner_of(None) is None
    assert owner_of("Basic xyz") is None


# --- add_split_to_event -----------------------------------------------------------------------
def _event(obj) -> bytes:
    return b"data: " + json.dumps(obj).encode()


def test_event_with_usage_gets_split():
    ev = _event({"id": "x", "choices": [], "usage": {"prompt_tokens": 10}})
    out = add_split_to_event(ev, SPLIT)
    assert out.startswith(b"data: ")
    chunk = json.loads(out[6:])
    assert chunk[RESPONSE_FIELD] == SPLIT
    assert chunk["usage"] == {"prompt_tokens": 10}
    assert chunk["id"] == "x"


@pytest.mark.parametrize(
    "event",
    [
        _event({"choices": [{"delta": {"content": "hi"}}], "usage": None}),
        _event({"choices": [{"delta": {"content": '"usage"'}}]}),
        _event({"usage": {}}),
        b"data: [DONE]",
        b"event: ping",
        b': comment "usage"',
        b'data: {"usage": {"prompt_tokens": 1}',  # malformed JSON
        b'data: ["usage"]',
    ],
)
def test_events_left_alone(event):
    assert add_split_to_event(event, SPLIT) == event


def test_no_split_leaves_event():
    ev = _event({"usage": {"prompt_tokens": 1}})
    assert add_split_to_event(ev, None) == ev


# --- the ASGI middleware ----------------------------------------------------------------------
class FakeControl:
    def __init__(self, result=SPLIT, error: Exception | None = None) -> None:
        self.result = result
        self.error = error
        self.calls: list[tuple[str, dict]] = []

    async def call(self, request: ControlRequest[Any]) -> Any:
        """As the real client: the request's fields recorded, the answer parsed."""
        self.calls.append((request.op, request.model_dump(exclude_unset=True)))
        if self.error is not None:
            raise self.error
        return parse_answer(request, self.result)


def fake_app_state(control) -> SimpleNamespace:
    return SimpleNamespace(state=SimpleNamespace(kvbranch=SimpleNamespace(control=control)))


class FakeApp:
    """Reads the whole request, then sends ``response`` messages."""

    def __init__(
        self, status: int, content_type: bytes, chunks: list[bytes], extra_headers=()
    ) -> None:
        self.status = status
        self.content_type = content_type
        self.chunks = chunks
        self.extra_headers = list(extra_headers)
        self.scope: dict | None = None
        self.body = b""

    async def __call__(self, scope, receive, send):
        self.scope = scope
        while True:
            message = await receive()
            self.body += message.get("body", b"")
            if not message.get("more_body"):
                break
        headers = [(b"content-type", self.content_type)] + self.extra_headers
        if self.content_type.startswith(b"application/json"):
            headers.append((b"content-length", str(sum(map(len, self.chunks))).encode()))
        await send({"type": "http.response.start", "status": self.status, "headers": headers})
        for i, chunk in enumerate(self.chunks):
            await send(
                {"type": "http.response.body", "body": chunk, "more_body": i < len(self.chunks) - 1}
            )


def run_asgi(
    app,
    *,
    path="/v1/chat/completions",
    method="POST",
    body=b"{}",
    headers=(),
    control=None,
    app_obj="default",
    body_parts: int = 1,
):
    scope = {
        "type": "http",
        "method": method,
        "path": path,
        "headers": [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
        ]
        + list(headers),
    }
    if app_obj == "default":
        scope["app"] = fake_app_state(control)
    elif app_obj is not None:
        scope["app"] = app_obj
    step = max(1, -(-len(body) // body_parts))
    parts = [body[i : i + step] for i in range(0, len(body), step)] or [b""]
    incoming = [
        {"type": "http.request", "body": p, "more_body": i < len(parts) - 1}
        for i, p in enumerate(parts)
    ]
    sent: list[dict] = []

    async def receive():
        if incoming:
            return incoming.pop(0)
        await asyncio.sleep(0)
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    asyncio.run(KVBranchMiddleware(app)(scope, receive, send))
    return sent


def response_body(sent: list[dict]) -> bytes:
    return b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")


def start_headers(sent: list[dict]) -> dict:
    start = [m for m in sent if m["type"] == "http.response.start"]
    assert len(start) == 1
    return {k.lower(): v for k, v in start[0]["headers"]}


def split_bytes(data: bytes, sizes) -> list[bytes]:
    out, i = [], 0
    for size in sizes:
        out.append(data[i : i + size])
        i += size
    out.append(data[i:])
    return out


def test_json_response_gets_split_and_content_length():
    payload = {
        "id": "c1",
        "choices": [{"message": {"content": "hi"}}],
        "usage": {"prompt_tokens": 10, "completion_tokens": 1},
    }
    raw = json.dumps(payload).encode()
    app = FakeApp(200, b"application/json", split_bytes(raw, [5, 17, 3]))
    control = FakeControl()
    request = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    sent = run_asgi(
        app,
        body=json.dumps(request).encode(),
        control=control,
        body_parts=3,
        headers=[(BRANCH_HEADER.lower().encode(), b"feat")],
    )
    # request side: the app saw the rewritten body, with a matching content-length
    seen = json.loads(app.body)
    tag = seen["vllm_xargs"][TAG_XARG]
    assert tag.startswith("kvb-")
    assert seen["vllm_xargs"][BRANCH_XARG] == "feat"
    assert seen["messages"] == request["messages"]
    lengths = [v for k, v in app.scope["headers"] if k.lower() == b"content-length"]
    assert lengths == [str(len(app.body)).encode()]
    # response side
    assert control.calls == [("split", {"tag": tag})]
    body = response_body(sent)
    out = json.loads(body)
    assert out[RESPONSE_FIELD] == SPLIT
    assert {k: v for k, v in out.items() if k != RESPONSE_FIELD} == payload
    headers = start_headers(sent)
    assert headers[b"content-length"] == str(len(body)).encode()
    assert headers[b"content-type"] == b"application/json"
    assert [m["status"] for m in sent if m["type"] == "http.response.start"] == [200]
    assert sent[-1]["more_body"] is False


def test_each_request_gets_a_fresh_tag():
    tags = []
    for _ in range(2):
        app = FakeApp(200, b"application/json", [b'{"usage": {}}'])
        run_asgi(app, control=FakeControl())
        tags.append(json.loads(app.body)["vllm_xargs"][TAG_XARG])
    assert tags[0] != tags[1]


def test_owner_salts_request_when_keys_configured(monkeypatch):
    monkeypatch.setenv(ENV_API_KEYS, "secret")
    app = FakeApp(200, b"application/json", [b'{"usage": {}}'])
    run_asgi(
        app,
        body=b'{"vllm_xargs": {"kvbranch_owner": "t_forged"}}',
        headers=[(b"authorization", b"Bearer secret")],
        control=FakeControl(),
    )
    seen = json.loads(app.body)
    owner = owner_of("Bearer secret")
    assert seen["vllm_xargs"][OWNER_XARG] == owner
    assert seen["cache_salt"] == owner


def test_no_owner_without_keys(monkeypatch):
    monkeypatch.delenv(ENV_API_KEYS, raising=False)
    app = FakeApp(200, b"application/json", [b'{"usage": {}}'])
    run_asgi(app, headers=[(b"authorization", b"Bearer secret")], control=FakeControl())
    seen = json.loads(app.body)
    assert OWNER_XARG not in seen["vllm_xargs"]
    assert "cache_salt" not in seen


def test_json_without_usage_is_unchanged_but_content_length_kept():
    raw = b'{"object": "list", "data": []}'
    app = FakeApp(200, b"application/json", [raw[:4], raw[4:]])
    control = FakeControl()
    sent = run_asgi(app, control=control)
    assert response_body(sent) == raw
    assert start_headers(sent)[b"content-length"] == str(len(raw)).encode()
    assert control.calls == []


def test_sse_usage_chunk_gets_split_across_body_messages():
    events = [
        {"id": "c", "choices": [{"delta": {"role": "assistant"}}], "usage": None},
        {"id": "c", "choices": [{"delta": {"content": "Hello"}}], "usage": None},
        {"id": "c", "choices": [], "usage": {"prompt_tokens": 10, "completion_tokens": 2}},
    ]
    stream = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)
    stream += b"data: [DONE]\n\n"
    chunks = split_bytes(stream, [7, 40, 1, 90, 33])
    app = FakeApp(200, b"text/event-stream; charset=utf-8", chunks)
    control = FakeControl()
    sent = run_asgi(app, control=control)
    assert start_headers(sent)[b"content-type"].startswith(b"text/event-stream")
    body = response_body(sent)
    assert body.endswith(b"data: [DONE]\n\n")
    out_events = [e for e in body.split(b"\n\n") if e]
    assert len(out_events) == 4
    parsed = [json.loads(e[6:]) for e in out_events[:3]]
    assert parsed[0] == events[0] and parsed[1] == events[1]
    assert parsed[2][RESPONSE_FIELD] == SPLIT
    assert parsed[2]["usage"] == events[2]["usage"]
    assert len(control.calls) == 1
    body_messages = [m for m in sent if m["type"] == "http.response.body"]
    assert body_messages[-1]["more_body"] is False
    assert all(m["more_body"] for m in body_messages[:-1])


def test_sse_without_usage_passes_bytes_through():
    stream = b'data: {"choices": [], "usage": null}\n\ndata: [DONE]\n\n'
    app = FakeApp(200, b"text/event-stream", split_bytes(stream, [10, 20]))
    control = FakeControl()
    sent = run_asgi(app, control=control)
    assert response_body(sent) == stream
    assert len(control.calls) <= 1  # at most one look-up per response


def test_sse_trailing_partial_event_is_flushed():
    stream = b'data: {"usage": null}\n\ndata: tail-without-terminator'
    app = FakeApp(200, b"text/event-stream", split_bytes(stream, [12]))
    sent = run_asgi(app, control=FakeControl())
    assert response_body(sent) == stream


@pytest.mark.parametrize(
    "status, ctype",
    [(400, b"application/json"), (500, b"application/json"), (404, b"text/event-stream")],
)
def test_non_200_passes_unchanged(status, ctype):
    raw = b'{"error": {"message": "bad"}, "usage": {"prompt_tokens": 1}}'
    app = FakeApp(status, ctype, [raw[:9], raw[9:]])
    control = FakeControl()
    sent = run_asgi(app, control=control)
    assert response_body(sent) == raw
    assert [m["status"] for m in sent if m["type"] == "http.response.start"] == [status]
    assert len([m for m in sent if m["type"] == "http.response.body"]) == 2
    assert control.calls == []


def test_control_error_leaves_response_intact():
    raw = b'{"usage": {"prompt_tokens": 1}}'
    app = FakeApp(200, b"application/json", [raw])
    control = FakeControl(error=RuntimeError("socket gone"))
    sent = run_asgi(app, control=control)
    assert response_body(sent) == raw
    assert len(control.calls) == 1


def test_a_split_with_transfer_params_puts_them_where_vllm_does():
    """P/D: the engine's split carries the transfer connector's params (typed as
    ``RequestSplit.kv_transfer_params``); they go top-level, and the split stays the public one."""
    params = {"do_remote_prefill": True, "remote_block_ids": [1, 2]}
    raw = b'{"usage": {"prompt_tokens": 1}}'
    app = FakeApp(200, b"application/json", [raw])
    sent = run_asgi(app, control=FakeControl(result=dict(SPLIT, kv_transfer_params=params)))
    out = json.loads(response_body(sent))
    assert out["kv_transfer_params"] == params and out[RESPONSE_FIELD] == SPLIT


def test_a_split_that_drifted_leaves_response_intact():
    raw = b'{"usage": {"prompt_tokens": 1}}'
    app = FakeApp(200, b"application/json", [raw])
    drifted = {k: v for k, v in SPLIT.items() if k != "host_hit_tokens"}
    assert response_body(run_asgi(app, control=FakeControl(result=drifted))) == raw


def test_no_split_available_leaves_response_intact():
    raw = b'{"usage": {"prompt_tokens": 1}}'
    app = FakeApp(200, b"application/json", [raw])
    sent = run_asgi(app, control=FakeControl(result=None))
    assert response_body(sent) == raw


@pytest.mark.parametrize(
    "app_obj",
    [
        None,
        SimpleNamespace(state=SimpleNamespace()),
        SimpleNamespace(state=SimpleNamespace(kvbranch=SimpleNamespace(control=None))),
    ],
)
def test_no_plugin_state_leaves_response_intact(app_obj):
    raw = b'{"usage": {"prompt_tokens": 1}}'
    app = FakeApp(200, b"application/json", [raw])
    sent = run_asgi(app, app_obj=app_obj)
    assert response_body(sent) == raw


@pytest.mark.parametrize(
    "path, method",
    [
        ("/v1/models", "GET"),
        ("/v1/chat/completions", "GET"),
        ("/kvbranch/v1/sessions", "POST"),
        ("/v1/embeddings", "POST"),
    ],
)
def test_other_routes_pass_through(path, method):
    body = b'{"vllm_xargs": {"kvbranch_tag": "client"}}'
    raw = b'{"usage": {"prompt_tokens": 1}}'
    app = FakeApp(200, b"application/json", [raw])
    control = FakeControl()
    sent = run_asgi(app, path=path, method=method, body=body, control=control)
    assert app.body == body
    assert response_body(sent) == raw
    assert control.calls == []


def test_completions_path_is_wrapped_too():
    app = FakeApp(200, b"application/json", [b'{"usage": {"prompt_tokens": 1}}'])
    control = FakeControl()
    sent = run_asgi(app, path="/v1/completions", body=b'{"prompt": "x"}', control=control)
    assert TAG_XARG in json.loads(app.body)["vllm_xargs"]
    assert json.loads(response_body(sent))[RESPONSE_FIELD] == SPLIT


@pytest.mark.parametrize("body", [b"not json", b"[1, 2]", b""])
def test_non_object_request_body_is_forwarded_untouched(body):
    raw = b'{"usage": {"prompt_tokens": 1}}'
    app = FakeApp(200, b"application/json", [raw])
    control = FakeControl()
    sent = run_asgi(app, body=body, control=control)
    assert app.body == body
    assert response_body(sent) == raw
    assert control.calls == []


def test_non_http_scope_passes_through():
    seen = {}

    async def app(scope, receive, send):
        seen["scope"] = scope

    scope = {"type": "lifespan"}
    asyncio.run(KVBranchMiddleware(app)(scope, None, None))
    assert seen["scope"] is scope


def test_oversized_request_body_is_forwarded_whole(monkeypatch):
    """Past MAX_BODY_BYTES the middleware stops buffering, but the app must still get every byte."""
    import server.plugin.middleware as mw

    monkeypatch.setattr(mw, "MAX_BODY_BYTES", 16)
    body = json.dumps({"model": "m", "prompt": "x" * 40}).encode()
    raw = b'{"usage": {"prompt_tokens": 1}}'
    app = FakeApp(200, b"application/json", [raw])
    control = FakeControl()
    sent = run_asgi(app, body=body, body_parts=5, control=control)
    assert app.body == body
    assert response_body(sent) == raw
    assert control.calls == []


# --- an aggregated replica's session turn: the pull cost model measures it --------------------


@pytest.mark.parametrize(
    ("content_type", "measured"),
    [(b"text/event-stream", 1), (b"application/json", 0)],  # a JSON answer comes after decode
)
def test_a_session_turn_is_measured_from_its_first_streamed_event(content_type, measured):
    from server.index import MemoryIndexStore
    from server.plugin.peer_pull import PeerPulls

    store = MemoryIndexStore(hold_ttl_s=60)
    pulls = PeerPulls(store, instance_id="me", url="http://me:8000", secret=b"s" * 32)
    control = FakeControl(result=dict(SPLIT, prompt_tokens=1000, recomputed_tokens=992))
    app_obj = SimpleNamespace(state=SimpleNamespace(kvbranch=SimpleNamespace(control=control)))
    app_obj.state.kvbranch.peer_pulls = pulls
    if content_type == b"text/event-stream":
        events = [{"choices": [{"delta": {"role": "assistant"}}]}, {"choices": [], "usage": {}}]
        chunks = [b"data: " + json.dumps(e).encode() + b"\n\n" for e in events]
    else:
        chunks = [b'{"usage": {"prompt_tokens": 1000}}']
    body = json.dumps({"model": "m", "messages": [], "session_id": "s"}).encode()
    run_asgi(FakeApp(200, content_type, chunks), body=body, app_obj=app_obj)
    assert pulls.counts.turns == 1
    assert pulls.cost.prefill.samples == measured


@pytest.mark.parametrize(("held", "level"), [(0, 3), (6500, 0)])
def test_a_turn_pulling_its_history_is_ranked_after_its_claim_by_what_is_left(
    monkeypatch, held, level
):
    """The priority is set once the peer pull's claim is known: a moved session's history,
    pulled, is no prefill here (server/plugin/priority.py)."""
    import server.plugin.middleware as mw
    from server.common.env import ENV_PRIORITY_AGING_S
    from server.common.priority_code import level_in
    from server.plugin.peer_pull import PeerTurn

    monkeypatch.setenv(ENV_PRIORITY_AGING_S, "8")

    async def begin(scope, payload, path, engine=0):
        return PeerTurn(("t", "s", "main"), 2, source="peer" if held else "local", held_tokens=held)

    monkeypatch.setattr(mw, "_begin_peer_turn", begin)
    history = " ".join(f"obs{i}" for i in range(3000))
    messages = [{"role": "system", "content": history}, {"role": "user", "content": "Go on."}]
    body = json.dumps({"model": "m", "messages": messages, "session_id": "s"}).encode()
    app = FakeApp(200, b"application/json", [b'{"usage": {"prompt_tokens": 1}}'])
    run_asgi(app, body=body)
    assert level_in(json.loads(app.body)["priority"]) == level
