"""The client over a fake transport: configuration, request bodies, error mapping, results and
streamed chunks."""

from __future__ import annotations

import httpx
import pytest

from sdk import (
    NO_RETRY,
    APIResponseError,
    AuthenticationError,
    BadRequestError,
    ConflictError,
    KVBranchUnavailableError,
    NotFoundError,
    RateLimitError,
    ServerError,
)
from sdk.contract import BRANCH_XARG, RESPONSE_FIELD
from sdk.testing import FakeKVBranchServer, FakeToolCall, Reply

MESSAGES = [{"role": "user", "content": "hello"}]


def client_for(driver, handler, **kwargs):
    kwargs.setdefault("retry", NO_RETRY)
    return driver.client("http://test", transport=httpx.MockTransport(handler), **kwargs)


# --- configuration ----------------------------------------------------------------------------
def test_base_url_and_key_from_environment(driver, monkeypatch):
    monkeypatch.setenv("KVBRANCH_BASE_URL", "http://kvb.example:9000/v1/")
    monkeypatch.setenv("KVBRANCH_API_KEY", "secret-1")
    monkeypatch.setenv("OPENAI_BASE_URL", "http://openai.example/v1")
    monkeypatch.setenv("OPENAI_API_KEY", "secret-2")
    client = driver.client()
    assert client.base_url == "http://kvb.example:9000" and client.api_key == "secret-1"
    monkeypatch.delenv("KVBRANCH_BASE_URL")
    monkeypatch.delenv("KVBRANCH_API_KEY")
    client = driver.client()
    assert client.base_url == "http://openai.example" and client.api_key == "secret-2"
    assert driver.client("http://arg:1", api_key="k").base_url == "http://arg:1"


def test_default_base_url(driver, monkeypatch):
    for name in ("KVBRANCH_BASE_URL", "OPENAI_BASE_URL", "KVBRANCH_API_KEY", "OPENAI_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    client = driver.client()
    assert client.base_url == "http://127.0.0.1:8000" and client.api_key is None


def test_bad_configuration_is_rejected(driver):
    with pytest.raises(ValueError, match="base_url"):
        driver.client("localhost:8000")
    with pytest.raises(ValueError, match="timeout"):
        driver.client("http://x", timeout=0)


def test_api_key_and_headers_are_sent(driver, monkeypatch):
    monkeypatch.delenv("KVBRANCH_API_KEY", raising=False)
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    fake = FakeKVBranchServer()
    client = driver.client(
        "http://fake",
        api_key="sk-test",
        transport=fake.transport(),
        default_headers={"X-Team": "a"},
    )
    client.chat(MESSAGES, extra_headers={"X-Trace": "t1"})
    headers = fake.requests[-1][3]
    assert headers["authorization"] == "Bearer sk-test"
    assert headers["x-team"] == "a" and headers["x-trace"] == "t1"
    assert headers["user-agent"].startswith("kvbranch-sdk/")
    no_key = driver.client("http://fake", transport=fake.transport())
    no_key.chat(MESSAGES)
    assert "authorization" not in fake.requests[-1][3]


def test_model_is_discovered_once(driver):
    fake = FakeKVBranchServer(model="the-model")
    client = driver.client("http://fake", transport=fake.transport())
    client.chat(MESSAGES)
    client.chat(MESSAGES)
    assert fake.paths().count("GET /v1/models") == 1
    assert fake.chat_requests()[0]["model"] == "the-model"


# --- request bodies ---------------------------------------------------------------------------
def test_chat_request_body(driver):
    fake = FakeKVBranchServer()
    client = driver.client("http://fake", transport=fake.transport(), model="fake-model")
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    client.chat(
        MESSAGES,
        session_id="s1",
        branch_id="b1",
        temperature=0,
        max_tokens=7,
        stop="END",
        tools=tools,
        tool_choice="auto",
        top_p=0.5,
        seed=3,
        extra_body={"vllm_xargs": {"other": 1}, "repetition_penalty": 1.1},
    )
    body = fake.chat_requests()[-1]
    assert body["session_id"] == "s1"
    assert body["vllm_xargs"] == {"other": 1, BRANCH_XARG: "b1"}
    assert body["stop"] == ["END"] and body["max_tokens"] == 7 and body["temperature"] == 0
    assert body["tools"] == tools and body["tool_choice"] == "auto"
    assert body["repetition_penalty"] == 1.1 and body["stream"] is False
    assert body["top_p"] == 0.5 and body["seed"] == 3
    client.chat_stream(MESSAGES).final()
    body = fake.chat_requests()[-1]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert "session_id" not in body and "vllm_xargs" not in body


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"messages": []}, "must not be empty"),
        ({"messages": "hello"}, "list of chat messages"),
        ({"messages": [{"content": "x"}]}, "no 'role'"),
        ({"messages": ["x"]}, "must be a dict"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -1}, "temperature"),
        ({"stop": [""]}, "stop"),
        ({"tools": [{"name": "f"}]}, "tools\\[0\\]"),
        ({"session_id": "bad id!"}, "session_id must be"),
        ({"branch_id": "b"}, "branch_id needs a session_id"),
        ({"extra_body": {"n": 2}}, "n > 1"),
        ({"session_id": "a", "extra_body": {"session_id": "b"}}, "conflicts"),
    ],
)
def test_bad_input_gives_clear_errors_before_sending(driver, kwargs, match):
    fake = FakeKVBranchServer()
    client = driver.client("http://fake", transport=fake.transport(), model="fake-model")
    kwargs = dict(kwargs)  # the parametrised dict is shared by both drivers' runs
    messages = kwargs.pop("messages", MESSAGES)
    with pytest.raises((ValueError, TypeError), match=match):
        client.chat(messages, **kwargs)
    assert fake.chat_requests() == []


# --- error mapping ----------------------------------------------------------------------------
def kv_error(status: int, message: str) -> dict:
    return {"error": {"message": message, "type": "X", "code": status}}


@pytest.mark.parametrize(
    "status,body,error,message",
    [
        (
            400,
            kv_error(400, "give either messages or token_offset"),
            BadRequestError,
            "give either messages",
        ),
        (
            422,
            {"detail": [{"loc": ["body", "ttl_s"], "msg": "must be > 0"}]},
            BadRequestError,
            "body.ttl_s: must be > 0",
        ),
        (401, {"error": "invalid api key"}, AuthenticationError, "invalid api key"),
        (403, {"detail": "forbidden"}, AuthenticationError, "forbidden"),
        (404, kv_error(404, "The model `x` does not exist."), NotFoundError, "model `x`"),
        (
            409,
            kv_error(409, "pin refused: the pin budget is full"),
            ConflictError,
            "pin budget is full",
        ),
        (429, kv_error(429, "slow down"), RateLimitError, "slow down"),
        (500, "Internal Server Error", ServerError, "Internal Server Error"),
        (502, b"", ServerError, "empty response body"),
    ],
)
def test_error_mapping_keeps_the_servers_message(driver, status, body, error, message):
    def handler(request):
        if isinstance(body, (str, bytes)):
            return httpx.Response(status, content=body)
        return httpx.Response(status, json=body)

    with pytest.raises(error) as info:
        client_for(driver, handler, model="m").chat(MESSAGES)
    assert message in info.value.message
    assert info.value.status_code == status
    assert str(status) in str(info.value)


def test_kvbranch_route_404_on_a_plain_server_is_distinguished(driver):
    def handler(request):
        if request.url.path.startswith("/v1/kvbranch"):
            return httpx.Response(404, json={"detail": "Not Found"})
        return httpx.Response(404, json=kv_error(404, "session 's' not found"))

    client = client_for(driver, handler)
    with pytest.raises(KVBranchUnavailableError, match="no kvbranch routes"):
        client.stats()
    with pytest.warns(RuntimeWarning, match="no kvbranch routes"):
        assert client.kvbranch_available() is False


def test_kvbranch_404_is_a_plain_not_found(driver):
    fake = FakeKVBranchServer()
    client = driver.client("http://fake", transport=fake.transport())
    with pytest.raises(NotFoundError, match="session 'nope' not found") as info:
        client.get_session("nope")
    assert not isinstance(info.value, KVBranchUnavailableError)


def test_non_json_success_body(driver):
    client = client_for(driver, lambda r: httpx.Response(200, content=b"<html>"), model="m")
    with pytest.raises(APIResponseError, match="not JSON"):
        client.chat(MESSAGES)
    client = client_for(driver, lambda r: httpx.Response(200, json={"unexpected": 1}), model="m")
    with pytest.raises(APIResponseError, match="not a chat completion"):
        client.chat(MESSAGES)


# --- results ----------------------------------------------------------------------------------
def test_chat_result_fields(driver):
    body = {
        "id": "c1",
        "model": "m",
        "choices": [
            {
                "index": 0,
                "finish_reason": "tool_calls",
                "message": {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "call_1",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'},
                        }
                    ],
                },
            }
        ],
        "usage": {
            "prompt_tokens": 300,
            "completion_tokens": 9,
            "total_tokens": 309,
            "prompt_tokens_details": {"cached_tokens": 256},
        },
        RESPONSE_FIELD: {
            "session_id": "s",
            "branch_id": "main",
            "prompt_tokens": 300,
            "device_hit_tokens": 128,
            "host_hit_tokens": 128,
            "recomputed_tokens": 44,
        },
    }
    result = client_for(driver, lambda r: httpx.Response(200, json=body), model="m").chat(MESSAGES)
    assert result.text == "" and result.finish_reason == "tool_calls" and result.model == "m"
    (call,) = result.tool_calls
    assert call.name == "get_weather" and call.parsed_arguments() == {"city": "Oslo"}
    assert result.usage.cached_tokens == 256 == result.cached_tokens
    assert result.split.host_hit_tokens == 128 and result.split.recomputed_tokens == 44
    assert result.message == {
        "role": "assistant",
        "content": None,
        "tool_calls": body["choices"][0]["message"]["tool_calls"],
    }
    assert result.latency_s is not None and result.latency_s >= 0


def test_stream_chunks_tool_call_deltas_usage_and_split(driver):
    fake = FakeKVBranchServer(
        reply=lambda m: Reply(
            content="Let me check.",
            tool_calls=[FakeToolCall("get_weather", '{"city": "Oslo"}', id="call_7")],
        )
    )
    client = driver.client("http://fake", transport=fake.transport(), model="fake-model")
    stream = client.chat_stream(MESSAGES, session_id="s1")
    chunks = list(stream)
    content = "".join(c.content or "" for c in chunks)
    deltas = [d for c in chunks for d in c.tool_calls]
    assert content == "Let me check."
    assert deltas[0].index == 0 and deltas[0].id == "call_7" and deltas[0].name == "get_weather"
    assert "".join(d.arguments or "" for d in deltas) == '{"city": "Oslo"}'
    assert len(deltas) > 2  # the arguments came in pieces
    assert chunks[-1].usage is not None and chunks[-1].split is not None
    assert [c.finish_reason for c in chunks if c.finish_reason] == ["tool_calls"]
    assert all(c.model == "fake-model" for c in chunks)
    result = stream.result
    assert result.text == "Let me check." and result.finish_reason == "tool_calls"
    assert result.tool_calls[0].parsed_arguments() == {"city": "Oslo"}
    assert result.usage.prompt_tokens > 0 and result.split.session_id == "s1"
    assert stream.ttft_s is not None and 0 <= stream.ttft_s <= result.latency_s


def test_stream_result_before_the_end_is_an_error(driver):
    fake = FakeKVBranchServer()
    stream = driver.client(
        "http://fake", transport=fake.transport(), model="fake-model"
    ).chat_stream(MESSAGES)
    with pytest.raises(RuntimeError, match="not finished"):
        _ = stream.result
    stream.close()


def test_stream_ending_without_finish_is_interrupted(driver):
    from sdk import StreamInterruptedError

    def handler(request):
        return httpx.Response(
            200,
            headers={"content-type": "text/event-stream"},
            content=(b'data: {"choices":[{"index":0,"delta":{"content":"par"}}]}\n\n'),
        )

    stream = client_for(driver, handler, model="m").chat_stream(MESSAGES)
    with pytest.raises(StreamInterruptedError, match="before the answer finished"):
        list(stream)


def test_client_round_trip(driver):
    fake = FakeKVBranchServer()
    with driver.client("http://fake", transport=fake.transport()) as client:
        health = client.health()
        info = client.create_session("s-rt", pin_ttl_s=30)
        result = client.chat(MESSAGES, session_id="s-rt", temperature=0)
        stream = client.chat_stream(MESSAGES, session_id="s-rt")
        chunks = list(stream)
        branch = client.fork_branch("s-rt", branch_id="b2", token_offset=0)
        pinned = client.pin_branch("s-rt", "b2", 60)
        branches = client.list_branches("s-rt")
        unpinned = client.unpin_branch("s-rt", "b2")
        prefetch = client.prefetch_branch("s-rt", "main")
        stats = client.stats()
        deleted_branch = client.delete_branch("s-rt", "b2")
        deleted = client.delete_session("s-rt")
    assert health.status == "ok" and info.pin_ttl_s == 30
    assert result.text == stream.result.text == "echo 1: hello" and chunks
    assert stream.result.split.device_hit_tokens > 0  # the second request reused the first
    assert branch.parent == "main" and pinned.pinned and not unpinned.pinned
    assert sorted(b.branch_id for b in branches) == ["b2", "main"]
    assert prefetch.status == "scheduled" and deleted_branch.deleted == "b2"
    assert stats.requests == 2 and deleted.deleted == "s-rt"
    assert fake.requests[1][1] == "/v1/kvbranch/sessions"
    assert fake.requests[1][2] == {"session_id": "s-rt", "pin_ttl_s": 30, "auto_pin": True}


def test_an_unreachable_server_says_how_to_start_one():
    import httpx as _httpx

    from sdk.errors import APIConnectionError, error_from_transport

    err = error_from_transport(_httpx.ConnectError("Connection refused"), url="http://h:1/x")
    assert isinstance(err, APIConnectionError) and err.retryable
    assert "cannot connect to http://h:1/x" in str(err)
    assert "python -m server" in str(err) and "KVBRANCH_BASE_URL" in str(err)
    assert "\n" not in str(err)  # one line


def test_unknown_chat_keyword_is_a_type_error(driver):
    fake = FakeKVBranchServer()
    client = driver.client("http://fake", transport=fake.transport(), model="fake-model")
    with pytest.raises(TypeError, match="temprature"):
        client.chat(MESSAGES, temprature=0)
    with pytest.raises(TypeError, match="temprature"):
        client.chat_stream(MESSAGES, temprature=0)
    assert fake.chat_requests() == []


def test_models_and_context_length(driver):
    fake = FakeKVBranchServer(model="the-model")
    client = driver.client("http://fake", transport=fake.transport())
    assert client.models() == ["the-model"]
    assert client.resolve_model() == "the-model" == client.model
    assert client.resolve_model("other") == "other"
    assert client.kvbranch_available() is True
