"""ChatKVBranch without a server: LangChain's standard unit suite, and the kvbranch behaviour
(session/branch routing, LangGraph ids, forks, prefetch on tool calls, streaming metadata)
against the sdk's in-process fake server."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_tests.unit_tests import ChatModelUnitTests

from integrations.langchain import ChatKVBranch
from sdk import NO_RETRY
from sdk.testing import FakeKVBranchServer, FakeToolCall, Reply, default_reply


class TestChatKVBranchStandardUnit(ChatModelUnitTests):
    @property
    def chat_model_class(self) -> type[ChatKVBranch]:
        return ChatKVBranch

    @property
    def chat_model_params(self) -> dict:
        return {
            "model": "SmolLM2-135M-Instruct",
            "base_url": "http://127.0.0.1:9",
            "api_key": "test",
        }

    @property
    def init_from_env_params(self) -> tuple[dict, dict, dict]:
        return ({"KVBRANCH_BASE_URL": "http://127.0.0.1:8123"}, {"model": "m"}, {"base_url": None})


# --- behaviour against the fake server -------------------------------------------------------
def make(fake: FakeKVBranchServer, **kwargs) -> ChatKVBranch:
    return ChatKVBranch(
        base_url="http://fake",
        model=fake.model,
        transport=fake.transport(),
        async_transport=fake.transport(),
        max_retries=0,
        **kwargs,
    )


def ids(body: dict) -> tuple[str | None, str | None]:
    return body.get("session_id"), (body.get("vllm_xargs") or {}).get("kvbranch_branch")


def test_invoke_without_session_sends_no_ids_and_maps_usage():
    fake = FakeKVBranchServer()
    llm = make(fake, temperature=0, max_tokens=5, stop=["x"])
    msg = llm.invoke("hello there", stop=["y"])
    body = fake.chat_requests()[-1]
    assert ids(body) == (None, None)
    assert body["stop"] == ["x", "y"] and body["max_tokens"] == 5 and body["temperature"] == 0
    assert msg.content == "echo 1: hello there"
    assert msg.usage_metadata["input_tokens"] == 3
    assert msg.usage_metadata["input_token_details"] == {"cache_read": 0}
    assert msg.response_metadata["model_name"] == "fake-model"
    assert msg.response_metadata["finish_reason"] == "stop"


def test_instance_session_and_cache_split():
    fake = FakeKVBranchServer()
    llm = make(fake, session_id="s1")
    history = [HumanMessage("one two three")]
    first = llm.invoke(history)
    second = llm.invoke(history + [first, HumanMessage("four")])
    assert ids(fake.chat_requests()[-1]) == ("s1", None)
    meta = second.response_metadata
    assert meta["session_id"] == "s1" and meta["branch_id"] == "main"
    split = meta["kvbranch"]
    assert split["device_hit_tokens"] > 0
    assert second.usage_metadata["input_token_details"]["cache_read"] == split["device_hit_tokens"]


def test_auto_session_and_per_call_ids():
    fake = FakeKVBranchServer()
    llm = make(fake, auto_session=True)
    assert llm.session_id and llm.session_id.startswith("lc-")
    llm.invoke("a")
    assert ids(fake.chat_requests()[-1]) == (llm.session_id, None)
    llm.invoke("a", session_id="other", branch_id="b2")
    assert ids(fake.chat_requests()[-1]) == ("other", "b2")
    llm.invoke(
        "a", config={"metadata": {"kvbranch_session_id": "meta", "kvbranch_branch_id": "mb"}}
    )
    assert ids(fake.chat_requests()[-1]) == ("meta", "mb")


def test_langgraph_thread_and_checkpoint_ids():
    fake = FakeKVBranchServer()
    llm = make(fake)
    llm.invoke("a", config={"configurable": {"thread_id": "T1"}})
    assert ids(fake.chat_requests()[-1]) == ("T1", None)
    # after LangGraph time travel: a branch of its own, forked on the server from main
    llm.invoke("a", config={"metadata": {"thread_id": "T1", "checkpoint_id": "1f0-abc"}})
    assert ids(fake.chat_requests()[-1]) == ("T1", "ckpt-1f0-abc")
    assert "POST /v1/kvbranch/sessions/T1/branches" in fake.paths()
    branches = fake.sessions["T1"]["branches"]
    assert branches["ckpt-1f0-abc"]["parent"] == "main"
    n = len(fake.paths())
    llm.invoke("a", config={"metadata": {"thread_id": "T1", "checkpoint_id": "1f0-abc"}})
    assert fake.paths()[n:] == ["POST /v1/chat/completions"]  # forked once only


def test_fork_binds_a_new_branch():
    fake = FakeKVBranchServer()
    llm = make(fake, session_id="s2")
    llm.invoke("plan the trip")
    alt = llm.fork("plan-b")
    assert (alt.session_id, alt.branch_id, alt.fork_parent) == ("s2", "plan-b", "main")
    assert fake.sessions["s2"]["branches"]["plan-b"]["parent"] == "main"
    alt.invoke("plan the trip")
    assert ids(fake.chat_requests()[-1]) == ("s2", "plan-b")
    llm.invoke("x")
    assert ids(fake.chat_requests()[-1]) == ("s2", None)  # the original is unchanged


def test_lazy_fork_inside_a_thread():
    fake = FakeKVBranchServer()
    llm = make(fake)
    alt = llm.fork("alt")  # no session known yet
    assert alt.session_id is None
    llm.invoke("a", config={"configurable": {"thread_id": "T9"}})  # the thread's main
    alt.invoke("a", config={"configurable": {"thread_id": "T9"}})
    assert ids(fake.chat_requests()[-1]) == ("T9", "alt")
    assert fake.sessions["T9"]["branches"]["alt"]["parent"] == "main"


def tool_reply(messages):
    if messages[-1]["role"] == "tool":
        return default_reply(messages)
    return Reply(
        tool_calls=[
            FakeToolCall("get_weather", '{"city": "Paris"}', id="c1"),
            FakeToolCall("get_weather", '"Paris"', id="c2"),
        ]
    )


def get_weather(city: str) -> str:
    """Weather of a city."""
    return "sunny"


def wait_for(predicate, timeout=5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return False


def test_tool_calls_invalid_args_and_prefetch():
    fake = FakeKVBranchServer(reply=tool_reply)
    llm = make(fake, session_id="s3").bind_tools([get_weather], tool_choice="any")
    msg = llm.invoke("weather in Paris?")
    body = fake.chat_requests()[-1]
    assert body["tool_choice"] == "required"
    assert body["tools"][0]["function"]["name"] == "get_weather"
    assert msg.tool_calls == [
        {"name": "get_weather", "args": {"city": "Paris"}, "id": "c1", "type": "tool_call"}
    ]
    assert msg.invalid_tool_calls[0]["args"] == '"Paris"'  # not a JSON object
    assert wait_for(lambda: "POST /v1/kvbranch/sessions/s3/branches/main/prefetch" in fake.paths())
    # the tool result goes back as a tool message
    answer = llm.invoke(
        [
            HumanMessage("weather?"),
            AIMessage("", tool_calls=msg.tool_calls),
            ToolMessage("sunny", tool_call_id="c1"),
        ]
    )
    sent = fake.chat_requests()[-1]["messages"]
    assert sent[1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'
    assert sent[2] == {"role": "tool", "tool_call_id": "c1", "content": "sunny"}
    assert answer.content.startswith("echo 3")


def test_named_tool_choice():
    fake = FakeKVBranchServer(reply=tool_reply)
    make(fake).bind_tools([get_weather], tool_choice="get_weather").invoke("x")
    assert fake.chat_requests()[-1]["tool_choice"] == {
        "type": "function",
        "function": {"name": "get_weather"},
    }
    with pytest.raises(ValueError):
        make(fake).bind_tools([get_weather], tool_choice="nope")


def test_strict_tools_default_leaves_strict_to_the_server():
    fake = FakeKVBranchServer(reply=tool_reply)
    make(fake).bind_tools([get_weather], tool_choice="any").invoke("x")
    assert "strict" not in fake.chat_requests()[-1]["tools"][0]["function"]


@pytest.mark.parametrize("strict", [True, False])
def test_strict_tools_is_the_default_of_bind_tools(strict):
    fake = FakeKVBranchServer(reply=tool_reply)
    make(fake, strict_tools=strict).bind_tools([get_weather], tool_choice="any").invoke("x")
    assert fake.chat_requests()[-1]["tools"][0]["function"]["strict"] is strict
    make(fake, strict_tools=strict).bind_tools([get_weather], strict=not strict).invoke("x")
    assert fake.chat_requests()[-1]["tools"][0]["function"]["strict"] is (not strict)


def test_prefetch_failure_never_fails_the_turn():
    fake = FakeKVBranchServer(reply=tool_reply)
    base = make(fake, session_id="s4")
    called = []

    def broken(*args):
        called.append(args)
        raise RuntimeError("prefetch exploded")

    base.client.prefetch_branch = broken
    assert base.bind_tools([get_weather], tool_choice="any").invoke("y").tool_calls
    assert wait_for(lambda: called)


def test_stream_chunks_tool_call_chunks_and_one_metadata_chunk():
    fake = FakeKVBranchServer(reply=tool_reply)
    llm = make(fake, session_id="s5").bind_tools([get_weather])
    chunks = list(llm.stream("weather?"))
    assert sum(1 for c in chunks if c.response_metadata.get("model_name")) == 1
    assert sum(1 for c in chunks if (c.usage_metadata or {}).get("input_tokens")) == 1
    assert any(c.tool_call_chunks for c in chunks)
    full = chunks[0]
    for c in chunks[1:]:
        full = full + c
    assert full.tool_calls[0]["args"] == {"city": "Paris"}
    assert full.invalid_tool_calls[0]["name"] == "get_weather"
    assert full.response_metadata["finish_reason"] == "tool_calls"
    assert full.response_metadata["kvbranch"]["session_id"] == "s5"
    assert full.chunk_position == "last"


def test_text_stream_and_callbacks():
    from langchain_core.callbacks import BaseCallbackHandler

    class Tokens(BaseCallbackHandler):
        def __init__(self):
            self.tokens = []

        def on_llm_new_token(self, token, **kwargs):
            self.tokens.append(token)

    fake = FakeKVBranchServer()
    cb = Tokens()
    llm = make(fake, session_id="s6")
    chunks = list(llm.stream("hello world", config={"callbacks": [cb]}))
    assert "".join(c.content for c in chunks) == "echo 1: hello world"
    assert "".join(cb.tokens) == "echo 1: hello world"
    assert fake.chat_requests()[-1]["stream_options"] == {"include_usage": True}
    # streaming=True makes invoke stream too
    msg = make(fake, streaming=True).invoke("abc")
    assert msg.content == "echo 1: abc" and msg.usage_metadata["input_tokens"] == 2


def test_async_paths():
    fake = FakeKVBranchServer(reply=tool_reply)

    async def run():
        llm = make(fake, session_id="s7")
        msg = await llm.bind_tools([get_weather]).ainvoke("x")
        chunks = [c async for c in llm.astream("hi")]
        alt = await llm.afork("a1")
        await alt.ainvoke("hi")
        out = await llm.abatch(["p", "q"])
        await asyncio.sleep(0.05)
        return msg, chunks, out

    msg, chunks, out = asyncio.run(run())
    assert msg.tool_calls[0]["args"] == {"city": "Paris"}
    assert any(c.response_metadata.get("model_name") for c in chunks)
    assert len(out) == 2
    assert "POST /v1/kvbranch/sessions/s7/branches/main/prefetch" in fake.paths()
    assert fake.sessions["s7"]["branches"]["a1"]["parent"] == "main"


def test_structured_output_methods_send_the_right_request():
    from pydantic import BaseModel

    class Person(BaseModel):
        name: str
        age: int

    fake = FakeKVBranchServer(reply=lambda m: Reply(content='{"name": "Al", "age": 3}'))
    llm = make(fake)
    assert llm.with_structured_output(Person).invoke("x") == Person(name="Al", age=3)
    rf = fake.chat_requests()[-1]["response_format"]
    assert rf["type"] == "json_schema" and rf["json_schema"]["name"] == "Person"
    assert llm.with_structured_output(Person, method="json_mode").invoke("x").age == 3
    assert fake.chat_requests()[-1]["response_format"] == {"type": "json_object"}
    raw = llm.with_structured_output(Person, include_raw=True).invoke("x")
    assert raw["parsed"].name == "Al" and raw["parsing_error"] is None


def test_plain_server_still_works():
    fake = FakeKVBranchServer(kvbranch=False)
    llm = make(fake, session_id="s8")
    with pytest.warns(RuntimeWarning):
        msg = llm.invoke("hi")
    assert ids(fake.chat_requests()[-1]) == (None, None)
    assert "kvbranch" not in msg.response_metadata
    assert llm.pin(60) is None and llm.prefetch() is None


def test_pin_and_ls_params():
    fake = FakeKVBranchServer()
    llm = make(fake, session_id="s9", temperature=0.5, max_tokens=7)
    llm.invoke("x")
    info = llm.pin(120)
    assert info.pinned and info.branch_id == "main"
    assert llm.unpin().pinned is False
    assert llm.prefetch().session_id == "s9"
    params = llm._get_ls_params(stop=["z"])
    assert params == {
        "ls_provider": "kvbranch",
        "ls_model_name": "fake-model",
        "ls_model_type": "chat",
        "ls_temperature": 0.5,
        "ls_max_tokens": 7,
        "ls_stop": ["z"],
    }
    with pytest.raises(ValueError):
        make(fake).pin(10)


def test_retries_come_from_the_sdk():
    fake = FakeKVBranchServer()
    llm = ChatKVBranch(
        base_url="http://fake", model=fake.model, transport=fake.transport(), max_retries=2
    )
    assert llm.client.retry.max_attempts == 3  # the sdk policy: 3 attempts
    fake.fail_next(503, headers={"Retry-After": "0"})
    assert llm.invoke("x").content == "echo 1: x"
    assert NO_RETRY.max_attempts == 1


class TemplateRefusingServer(FakeKVBranchServer):
    """Answers 400 to a fork that carries messages, as a server whose chat template cannot
    render them does."""

    def handle(self, request):
        body = json.loads(request.content) if request.content else None
        if (
            request.method == "POST"
            and request.url.path.endswith("/branches")
            and isinstance(body, dict)
            and body.get("messages")
            and body["messages"][0].get("content")
        ):
            self.requests.append((request.method, request.url.path, body, request.headers))
            return self._error(400, "the chat template cannot render these messages")
        return super().handle(request)


def test_afork_recovers_from_a_400_as_fork_does():
    """A fork whose messages the server refuses (400) still forks, sync and async alike."""
    for asynchronous in (False, True):
        fake = TemplateRefusingServer()
        llm = make(fake, session_id="s9")
        llm.invoke("plan the trip")
        if asynchronous:
            alt = asyncio.run(llm.afork("b400", at_messages=[HumanMessage("plan the trip")]))
        else:
            alt = llm.fork("b400", at_messages=[HumanMessage("plan the trip")])
        assert alt.branch_id == "b400"
        assert "b400" in fake.sessions["s9"]["branches"], f"async={asynchronous}"
        assert fake.sessions["s9"]["branches"]["b400"]["parent"] == "main"


def test_async_clients_are_per_loop_object_not_per_id():
    fake = FakeKVBranchServer()
    llm = make(fake)

    async def client_of_this_loop():
        return llm.async_client

    first = asyncio.run(client_of_this_loop())
    second = asyncio.run(client_of_this_loop())  # a new loop, possibly at the same address
    assert first is not second
    assert all(
        not loop.is_closed()  # closed loops dropped
        for loop in llm.conversation.clients.loops()
    )
