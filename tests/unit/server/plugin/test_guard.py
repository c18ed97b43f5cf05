"""server.plugin.guard: which chat-request ids are refused, and the size limit (ASGI, no
server)."""

from __future__ import annotations

import asyncio
import json

import pytest

from server.checks.ids import id_problem
from server.plugin.guard import KVBranchGuard


@pytest.mark.parametrize(
    "payload, session_header, branch_header, param",
    [
        ({"session_id": "s-1", "vllm_xargs": {"kvbranch_branch": "b.2"}}, None, None, None),
        ({}, None, None, None),
        ({"session_id": ""}, "", "", None),  # empty = none, as in vLLM
        ({"session_id": 5}, None, None, None),  # vLLM's own model refuses it
        ({"session_id": "../x"}, None, None, "session_id"),
        ({"session_id": "x" * 129}, None, None, "session_id"),
        ({}, "a b", None, "X-Session-ID"),
        ({"vllm_xargs": {"session_id": "😀"}}, None, None, "vllm_xargs.session_id"),
        ({"vllm_xargs": {"kvbranch_branch": 7}}, None, None, "vllm_xargs.kvbranch_branch"),
        ({"vllm_xargs": {"kvbranch_branch": {"a": 1}}}, None, None, "vllm_xargs.kvbranch_branch"),
        ({}, None, "../main", "X-KVBranch-Branch"),
        ({"vllm_xargs": "junk"}, None, None, None),  # vLLM refuses it itself
    ],
)
def test_id_problem(payload, session_header, branch_header, param):
    problem = id_problem(payload, session_header, branch_header)
    assert (problem[0] if problem else None) == param
    if problem:
        assert param in problem[1]


def _run(guard: KVBranchGuard, path: str, chunks: list[bytes], headers=()):
    sent: list[dict] = []
    reached: list[bytes] = []
    queue = [
        {"type": "http.request", "body": c, "more_body": i < len(chunks) - 1}
        for i, c in enumerate(chunks)
    ]

    async def receive():
        return queue.pop(0)

    async def send(message):
        sent.append(message)

    async def app(scope, receive, send):
        message = await receive()
        reached.append(message["body"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    guard.app = app
    scope = {"type": "http", "method": "POST", "path": path, "headers": list(headers)}
    asyncio.run(guard(scope, receive, send))
    return sent, reached, queue


def test_oversized_bodies_get_413_and_are_drained():
    guard = KVBranchGuard(None, max_body=10)
    sent, reached, left = _run(guard, "/v1/kvbranch/sessions", [b"123456", b"789012", b"3"])
    assert sent[0]["status"] == 413 and not reached and not left
    assert "larger than 10" in json.loads(sent[1]["body"])["error"]["message"]
    sent, reached, left = _run(
        guard, "/v1/chat/completions", [b"x" * 5], headers=[(b"content-length", b"50")]
    )
    assert sent[0]["status"] == 413 and not reached


def test_small_bodies_and_other_paths_pass_through_whole():
    guard = KVBranchGuard(None, max_body=10)
    sent, reached, _ = _run(guard, "/v1/kvbranch/sessions", [b"12345", b"6789"])
    assert sent[0]["status"] == 200 and reached == [b"123456789"]
    sent, reached, _ = _run(guard, "/v1/models", [b"x" * 50])
    assert sent[0]["status"] == 200 and reached == [b"x" * 50]


def test_bad_chat_session_id_is_400_before_the_app():
    guard = KVBranchGuard(None)
    body = json.dumps({"model": "m", "messages": [], "session_id": "a/b"}).encode()
    sent, reached, _ = _run(guard, "/v1/chat/completions", [body])
    assert sent[0]["status"] == 400 and not reached
    assert json.loads(sent[1]["body"])["error"]["param"] == "session_id"


@pytest.mark.parametrize(
    "path, fields, param",
    [
        ("/v1/chat/completions", {"stream": 1}, "stream"),
        ("/v1/completions", {"max_tokens": "5"}, "max_tokens"),
        ("/v1/chat/completions", {"stream": True, "max_tokens": 5}, None),
        ("/v1/responses", {"stream": 1}, None),  # no router serves it: vLLM's own rules
    ],
)
def test_field_types_the_router_refuses_are_refused_here_too(path, fields, param):
    guard = KVBranchGuard(None)
    body = json.dumps({"model": "m", "messages": [], "prompt": "x", **fields}).encode()
    sent, reached, _ = _run(guard, path, [body])
    if param is None:
        assert reached
        return
    assert sent[0]["status"] == 400 and not reached
    assert json.loads(sent[1]["body"])["error"]["param"] == param


@pytest.mark.parametrize(
    "path, payload, param",
    [
        (
            "/inference/v1/generate",
            {"sampling_params": {"extra_args": {"kvbranch_branch": "a b"}}},
            "sampling_params.extra_args.kvbranch_branch",
        ),
        (
            "/inference/v1/generate",
            {"sampling_params": {"extra_args": {"session_id": "../x"}}},
            "sampling_params.extra_args.session_id",
        ),
        ("/v1/responses", {"session_id": "a/b"}, "session_id"),
        ("/v1/messages", {"vllm_xargs": {"kvbranch_branch": "../m"}}, "vllm_xargs.kvbranch_branch"),
        ("/v1/systemone", {"vllm_xargs": {"kvbranch_branch": "../m"}}, None),  # takes no xargs
    ],
)
def test_id_problem_on_other_generating_routes(path, payload, param):
    problem = id_problem(payload, None, None, path)
    assert (problem[0] if problem else None) == param


def test_bad_responses_session_id_is_400_before_the_app():
    guard = KVBranchGuard(None)
    body = json.dumps({"model": "m", "input": "x", "session_id": "a/b"}).encode()
    sent, reached, _ = _run(guard, "/v1/responses", [body])
    assert sent[0]["status"] == 400 and not reached


# --- issue 22: hostile JSON is a named 400, never an exception after the answer ----------------
def _hostile(path: str, raw: bytes, monkeypatch=None):
    """Run ``raw`` through the guard; it must answer without raising (an exception after the
    answer makes uvicorn drop the keep-alive connection)."""
    sent, reached, _ = _run(KVBranchGuard(None), path, [raw])
    return sent, reached


def _error(sent: list[dict]) -> dict:
    body = sent[1]["body"]
    body.decode("utf-8")  # valid UTF-8, whatever the client sent
    return json.loads(body)["error"]


@pytest.mark.parametrize(
    "path, raw, param",
    [
        (
            "/v1/chat/completions",
            b'{"model":"m","messages":[],"prompt_cache_key":"\\ud800"}',
            "prompt_cache_key",
        ),
        ("/v1/chat/completions", b'{"model":"m","cache_salt":"\\udfff"}', "cache_salt"),
        (
            "/v1/messages",
            b'{"model":"m","max_tokens":4,"messages":[{"role":"user","content":[{"type":"text",'
            b'"text":"a\\ud800b","cache_control":{"type":"ephemeral"}}]}]}',
            "messages[0].content[0].text",
        ),
        # raw bytes of a surrogate (json.loads decodes bytes with 'surrogatepass')
        ("/v1/completions", b'{"model":"m","prompt":"x\xed\xa0\x80"}', "prompt"),
        ("/v1/responses", b'{"model":"m","input":"x","metadata":{"\\ud800":"k"}}', "metadata"),
        ("/v1/kvbranch/sessions", b'{"session_id":"\\ud800"}', "session_id"),
    ],
)
def test_a_lone_surrogate_is_a_named_400(path, raw, param):
    sent, reached = _hostile(path, raw)
    assert sent[0]["status"] == 400 and not reached
    error = _error(sent)
    assert error["param"].startswith(param) and "surrogate" in error["message"]


def test_a_lone_surrogate_salt_is_a_400_with_keys_too(monkeypatch):
    from server.common.env import ENV_API_KEYS

    monkeypatch.setenv(ENV_API_KEYS, "key-a")
    raw = b'{"model":"m","messages":[],"cache_salt":"\\ud800"}'
    sent, reached, _ = _run(
        KVBranchGuard(None),
        "/v1/chat/completions",
        [raw],
        headers=[(b"authorization", b"Bearer key-a")],
    )
    assert sent[0]["status"] == 400 and not reached
    assert _error(sent)["param"] == "cache_salt"


def test_valid_surrogate_pairs_and_plain_unicode_pass():
    raw = b'{"model":"m","messages":[{"role":"user","content":"\\ud83d\\ude00 \xc3\xa9"}]}'
    sent, reached = _hostile("/v1/chat/completions", raw)
    assert sent[0]["status"] == 200 and reached == [raw]


@pytest.mark.parametrize("depth", [101, 5000, 100_000])
def test_deep_nesting_is_a_400_not_a_recursion_error(depth):
    raw = b'{"model":"m","messages":' + b"[" * depth + b"]" * depth + b"}"
    sent, reached = _hostile("/v1/chat/completions", raw)
    assert sent[0]["status"] == 400 and not reached
    assert "nested too deeply" in _error(sent)["message"]
    sent, reached = _hostile("/v1/kvbranch/sessions", b"[" * depth + b"]" * depth)
    assert sent[0]["status"] == 400 and not reached


def test_ordinary_nesting_and_non_json_bodies_pass():
    raw = b'{"model":"m","messages":' + b"[" * 90 + b"]" * 90 + b"}"
    assert _hostile("/v1/chat/completions", raw)[0][0]["status"] == 200
    for junk in (b"not json", b"\xff\xfe\x00", b""):
        sent, reached = _hostile("/v1/chat/completions", junk)
        assert sent[0]["status"] == 200 and reached == [junk]  # vLLM answers it itself


@pytest.mark.parametrize("length", ["²", "١٢", "  7 ", "-1", "1e9"])
def test_an_odd_content_length_never_raises(length):
    """ "²".isdigit() is True and int("²") raises: the header is only trusted when ASCII."""
    sent, reached, _ = _run(
        KVBranchGuard(None, max_body=10),
        "/v1/chat/completions",
        [b"{}"],
        headers=[(b"content-length", length.encode("latin-1", "replace"))],
    )
    assert sent[0]["status"] == 200 and reached == [b"{}"]
