"""The benchmarks' stream timing reads a completion stream through the sdk's SSE parser and the
contract's split model: content, usage and the kvbranch split of the final chunk, for chat and
text completions, kvbranch and plain vLLM (pure logic: the transport is httpx's mock)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from benchmarks import common
from sdk.contract import BRANCH_XARG, CHAT_COMPLETIONS_PATH, COMPLETIONS_PATH, RESPONSE_FIELD


def _sse(chunks: list[dict]) -> bytes:
    # CRLF line ends and a keep-alive comment: what the sdk's parser must cope with.
    body = ": keep-alive\r\n\r\n" + "".join(f"data: {json.dumps(c)}\r\n\r\n" for c in chunks)
    return (body + "data: [DONE]\r\n\r\n").encode()


def _run(chunks: list[dict], path: str, seen: list[dict]) -> common.StreamResult:
    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content))
        return httpx.Response(
            200, content=_sse(chunks), headers={"content-type": "text/event-stream"}
        )

    async def go() -> common.StreamResult:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            body = {"model": "m", "messages": [], **common.session_fields("s1", "alt")}
            return await common.stream_request(client, f"http://x{path}", body)

    return asyncio.run(go())


def test_chat_stream_with_the_kvbranch_split() -> None:
    usage = {
        "prompt_tokens": 300,
        "completion_tokens": 2,
        "prompt_tokens_details": {"cached_tokens": 256},
    }
    split = {
        "session_id": "s1",
        "branch_id": "alt",
        "prompt_tokens": 300,
        "device_hit_tokens": 128,
        "host_hit_tokens": 128,
        "remote_hit_tokens": 0,
        "recomputed_tokens": 44,
    }
    chunks = [
        {"choices": [{"delta": {"role": "assistant"}}]},
        {"choices": [{"delta": {"content": "Pa"}}]},
        {"choices": [{"delta": {"content": "ris"}}]},
        {"choices": [], "usage": usage, RESPONSE_FIELD: split},
    ]
    seen: list[dict] = []
    res = _run(chunks, CHAT_COMPLETIONS_PATH, seen)
    assert res.content == "Paris"
    assert (res.prompt_tokens, res.completion_tokens, res.cached_tokens) == (300, 2, 256)
    assert (res.device_hit_tokens, res.host_hit_tokens, res.recomputed_tokens) == (128, 128, 44)
    assert res.split is not None and res.split["branch_id"] == "alt"
    assert 0 < res.ttft_s <= res.total_s
    sent = seen[0]
    assert sent["stream"] is True and sent["stream_options"] == {"include_usage": True}
    assert sent[common.SESSION_FIELD] == "s1"
    assert sent[common.XARGS_FIELD] == {BRANCH_XARG: "alt"}


def test_text_completion_on_plain_vllm_counts_cached_tokens_as_device_hits() -> None:
    usage = {
        "prompt_tokens": 200,
        "completion_tokens": 1,
        "prompt_tokens_details": {"cached_tokens": 128},
    }
    chunks = [{"choices": [{"text": "x"}]}, {"choices": [], "usage": usage}]
    res = _run(chunks, COMPLETIONS_PATH, [])
    assert res.content == "x" and res.split is None
    assert (res.device_hit_tokens, res.host_hit_tokens, res.recomputed_tokens) == (128, 0, 72)


def test_an_error_status_raises_with_the_server_message() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(400, json={"error": {"message": "bad session id"}})

    async def go() -> None:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            await common.stream_chat(client, "http://x", {})

    with pytest.raises(RuntimeError, match="HTTP 400.*bad session id"):
        asyncio.run(go())
