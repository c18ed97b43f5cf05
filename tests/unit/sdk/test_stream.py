"""The stream state shared by both clients: SSE events to chat chunks, ``[DONE]``, error
events, and a stream's rules (iterated once, no result before the end)."""

from __future__ import annotations

import json

import httpx
import pytest

from sdk import NO_RETRY
from sdk._stream import event_to_chunk
from sdk.errors import APIResponseError, ServerError
from sdk.sse import ServerSentEvent
from sdk.testing import FakeKVBranchServer

MESSAGES = [{"role": "user", "content": "hello"}]
SSE = {"content-type": "text/event-stream"}


def test_done_ends_and_chunks_parse():
    assert event_to_chunk(ServerSentEvent(data="[DONE]")) is None
    chunk = event_to_chunk(
        ServerSentEvent(
            data=json.dumps(
                {
                    "id": "c1",
                    "model": "m",
                    "choices": [
                        {
                            "index": 0,
                            "delta": {
                                "content": "hi",
                                "tool_calls": [
                                    {
                                        "index": 1,
                                        "id": "call_9",
                                        "type": "function",
                                        "function": {"name": "lookup", "arguments": '{"q"'},
                                    }
                                ],
                            },
                            "finish_reason": None,
                        }
                    ],
                }
            )
        )
    )
    assert chunk.content == "hi" and chunk.model == "m" and chunk.id == "c1"
    (delta,) = chunk.tool_calls
    assert (delta.index, delta.id, delta.name, delta.arguments) == (1, "call_9", "lookup", '{"q"')


def test_malformed_json_event_raises():
    with pytest.raises(APIResponseError, match="not JSON"):
        event_to_chunk(ServerSentEvent(data="{not json"))
    with pytest.raises(APIResponseError, match="not a JSON object"):
        event_to_chunk(ServerSentEvent(data="[1, 2]"))


def test_error_event_raises_the_servers_error():
    data = json.dumps(
        {"error": {"message": "engine died", "type": "InternalServerError", "code": 500}}
    )
    with pytest.raises(ServerError, match="engine died") as info:
        event_to_chunk(ServerSentEvent(data=data))
    assert info.value.status_code == 500


def streaming(driver, body: bytes):
    """A stream of a client whose server answers every request with ``body`` (SSE)."""
    transport = httpx.MockTransport(lambda r: httpx.Response(200, headers=SSE, content=body))
    client = driver.client("http://x", transport=transport, retry=NO_RETRY, model="m")
    return client.chat_stream(MESSAGES)


def test_error_event_mid_stream_raises_after_the_chunks_before_it(driver):
    body = (
        b'data: {"choices":[{"index":0,"delta":{"content":"par"}}]}\n\n'
        b'data: {"error":{"message":"engine died","type":"X","code":500}}\n\n'
    )
    stream = streaming(driver, body)
    seen = []
    with pytest.raises(ServerError, match="engine died"):
        for chunk in stream:
            seen.append(chunk.content)
    assert seen == ["par"]


def test_done_ends_the_stream_and_events_after_it_are_ignored(driver):
    body = (
        b'data: {"choices":[{"index":0,"delta":{"content":"a"}}]}\n\n'
        b"data: [DONE]\n\n"
        b'data: {"choices":[{"index":0,"delta":{"content":"late"}}]}\n\n'
    )
    stream = streaming(driver, body)
    assert [c.content for c in stream] == ["a"]
    assert stream.result.text == "a" and stream.text == "a"


def test_a_stream_is_iterated_once(driver):
    fake = FakeKVBranchServer()
    client = driver.client("http://fake", transport=fake.transport(), model="fake-model")
    stream = client.chat_stream(MESSAGES)
    assert stream.final().text == "echo 1: hello"
    with pytest.raises(RuntimeError, match="iterated only once"):
        list(stream)


def test_on_complete_gets_the_whole_answer(driver):
    fake = FakeKVBranchServer()
    client = driver.client("http://fake", transport=fake.transport(), model="fake-model")
    done = []
    stream = client.chat_stream(MESSAGES, on_complete=done.append)
    assert done == []
    result = stream.final()
    assert done == [result] and result.ttft_s is not None
