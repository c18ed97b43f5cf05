"""server.plugin.guard: which chat-request ids are refused, and the size limit (ASGI, no
server)."""

from __future__ import annotations

import asyncio
import json

import pytest

from server.plugin.guard import KVBranchGuard, id_problem


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
