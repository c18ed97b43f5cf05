"""KVBranchLLM (integrations/llamaindex) over the sdk's fake server: the LlamaIndex LLM surface
(sync/async × chat/complete × stream), metadata, usage and the cache split, tool calling,
session/branch binding, forks, background prefetch, and a FunctionAgent round trip."""

from __future__ import annotations

import asyncio
import json
import logging

import httpx
import pytest

pytest.importorskip("llama_index.core")

from llama_index.core.agent.workflow import FunctionAgent, ToolCallResult  # noqa: E402
from llama_index.core.base.llms.types import (  # noqa: E402
    ChatMessage,
    ChatResponse,
    ImageBlock,
    MessageRole,
    TextBlock,
    ToolCallBlock,
)
from llama_index.core.constants import DEFAULT_CONTEXT_WINDOW  # noqa: E402
from llama_index.core.llms.function_calling import FunctionCallingLLM  # noqa: E402
from llama_index.core.tools import FunctionTool, ToolMetadata  # noqa: E402

from integrations.llamaindex import KVBranchLLM  # noqa: E402
from integrations.llamaindex._convert import (  # noqa: E402
    resolve_tool_choice,
    to_openai_message,
    tool_kwargs,
)
from sdk import BadRequestError, KVBranchClient  # noqa: E402
from sdk.contract import BRANCH_XARG  # noqa: E402
from sdk.testing import FakeKVBranchServer, FakeToolCall, Reply  # noqa: E402

WEATHER = {"Paris": "sunny, 21 C", "Oslo": "snow, -3 C"}


def get_weather(city: str) -> str:
    """The current weather in a city."""
    return WEATHER.get(city, "unknown")


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


weather_tool = FunctionTool.from_defaults(get_weather)
add_tool = FunctionTool.from_defaults(add)


class Fake(FakeKVBranchServer):
    """The sdk's fake, reporting vLLM's ``max_model_len`` on ``/v1/models``."""

    max_model_len: int | None = 4096
    prefetch_failure: int | Exception | None = None

    def handle(self, request: httpx.Request) -> httpx.Response:
        if self.prefetch_failure is not None and request.url.path.endswith("/prefetch"):
            self.requests.append((request.method, request.url.path, None, request.headers))
            if isinstance(self.prefetch_failure, Exception):
                raise self.prefetch_failure
            return httpx.Response(
                self.prefetch_failure,
                json={
                    "error": {
                        "message": "injected",
                        "type": "Injected",
                        "code": self.prefetch_failure,
                    }
                },
            )
        response = super().handle(request)
        if (
            request.url.path == "/v1/models"
            and response.status_code == 200
            and self.max_model_len is not None
        ):
            data = json.loads(response.content)
            for model in data["data"]:
                model["max_model_len"] = self.max_model_len
            return httpx.Response(200, json=data)
        return response


def tool_then_answer(arguments: str = '{"city": "Paris"}', name: str = "get_weather"):
    """A fake model: a tool call after a user message, prose after a tool result."""

    def reply(messages):
        last = messages[-1]
        if last["role"] == "user":
            return Reply(tool_calls=[FakeToolCall(name=name, arguments=arguments, id="call_1")])
        if last["role"] == "tool":
            return Reply(content=f"It is {last['content']}.")
        return Reply(content="ok")

    return reply


@pytest.fixture
def fake():
    return Fake()


def make_llm(fake, **kwargs) -> KVBranchLLM:
    kwargs.setdefault("max_retries", 0)
    return KVBranchLLM(base_url="http://fake", transport=fake.transport(), **kwargs)


def openai_call(call_id: str, name: str, arguments: str) -> dict:
    """An OpenAI tool call as the wire and ``additional_kwargs["tool_calls"]`` carry it."""
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def user(text: str) -> ChatMessage:
    return ChatMessage(role=MessageRole.USER, content=text)


# --- class and metadata -------------------------------------------------------------------
def test_is_a_function_calling_llm_and_constructs_offline():
    assert FunctionCallingLLM in KVBranchLLM.__mro__
    assert not KVBranchLLM.__abstractmethods__
    failing = httpx.MockTransport(lambda r: (_ for _ in ()).throw(AssertionError("network")))
    llm = KVBranchLLM(base_url="http://x/v1", transport=failing, session_id="s-1")
    assert llm.base_url == "http://x" and llm.session_id == "s-1" and llm.branch_id == "main"
    assert llm.class_name() == "KVBranchLLM"
    assert "api_key" not in KVBranchLLM(api_key="secret").to_dict()


def test_each_instance_has_its_own_session_id():
    assert KVBranchLLM().session_id != KVBranchLLM().session_id
    with pytest.raises(ValueError):
        KVBranchLLM(session_id="bad id!")


def test_metadata_reads_the_context_window_from_the_server(fake):
    meta = make_llm(fake, max_tokens=64).metadata
    assert meta.context_window == 4096
    assert meta.num_output == 64
    assert meta.is_chat_model and meta.is_function_calling_model
    assert meta.model_name == "fake-model"
    assert make_llm(fake, context_window=1000).metadata.context_window == 1000
    assert (
        make_llm(fake, is_function_calling_model=False).metadata.is_function_calling_model is False
    )


def test_metadata_falls_back_when_the_server_is_unreachable_or_silent(caplog):
    def refuse(request):
        raise httpx.ConnectError("refused")

    llm = KVBranchLLM(base_url="http://down", transport=httpx.MockTransport(refuse))
    with caplog.at_level(logging.WARNING, logger="kvbranch.llamaindex"):
        assert llm.metadata.context_window == DEFAULT_CONTEXT_WINDOW
    assert "context window" in caplog.text
    silent = Fake()
    silent.max_model_len = None
    assert make_llm(silent).metadata.context_window == DEFAULT_CONTEXT_WINDOW


def test_sdk_max_model_len(fake):
    client = KVBranchClient("http://fake", transport=fake.transport())
    assert client.max_model_len() == 4096
    assert client.max_model_len("fake-model") == 4096
    assert client.max_model_len("other") is None


# --- chat and complete --------------------------------------------------------------------
def test_chat_sends_session_and_branch_and_reports_usage_and_split(fake):
    llm = make_llm(fake, temperature=0, max_tokens=16)
    system = ChatMessage(role=MessageRole.SYSTEM, content="be brief")
    first = llm.chat([system, user("hello")])
    assert first.message.role == MessageRole.ASSISTANT
    assert first.message.content == "echo 2: hello"
    body = fake.chat_requests()[-1]
    assert body["session_id"] == llm.session_id
    assert body["vllm_xargs"][BRANCH_XARG] == "main"
    assert body["temperature"] == 0 and body["max_tokens"] == 16
    assert body["messages"] == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hello"},
    ]
    info = first.additional_kwargs
    assert info["prompt_tokens"] == info["kvbranch"]["prompt_tokens"] > 0
    assert info["kvbranch"]["session_id"] == llm.session_id
    assert info["session_id"] == llm.session_id and info["branch_id"] == "main"
    assert info["latency_s"] > 0 and info["ttft_s"] is None
    assert first.raw["kvbranch"] == info["kvbranch"]
    # the next turn extends the conversation: the fake reuses the cached prefix
    second = llm.chat([system, user("hello"), first.message, user("again")], max_tokens=8)
    assert second.additional_kwargs["cached_tokens"] > 0
    assert second.additional_kwargs["kvbranch"]["device_hit_tokens"] > 0
    assert fake.chat_requests()[-1]["max_tokens"] == 8
    assert llm.history[-1] == {"role": "assistant", "content": second.message.content}
    assert len(llm.history) == 5
    # the server session was created once, with this LLM's id
    assert fake.paths().count("POST /v1/kvbranch/sessions") == 1
    assert llm.session_id in fake.sessions


def test_stream_chat_deltas_add_up_and_the_last_response_carries_usage(fake):
    llm = make_llm(fake)
    responses = list(llm.stream_chat([user("tell me something")]))
    assert "".join(r.delta or "" for r in responses) == "echo 1: tell me something"
    assert responses[-2].message.content == "echo 1: tell me something"
    last = responses[-1]
    assert last.delta == "" and last.message.content == "echo 1: tell me something"
    info = last.additional_kwargs
    assert info["ttft_s"] is not None and info["ttft_s"] <= info["latency_s"]
    assert info["kvbranch"]["branch_id"] == "main" and info["completion_tokens"] == 5
    assert fake.chat_requests()[-1]["stream"] is True
    assert llm.history[-1]["content"] == "echo 1: tell me something"


def test_stream_is_lazy(fake):
    llm = make_llm(fake)
    gen = llm.stream_chat([user("x")])
    assert fake.chat_requests() == []
    list(gen)
    assert len(fake.chat_requests()) == 1


def test_complete_and_stream_complete(fake):
    llm = make_llm(fake)
    done = llm.complete("a prompt")
    assert done.text == "echo 1: a prompt"
    assert done.additional_kwargs["kvbranch"]["prompt_tokens"] > 0
    assert fake.chat_requests()[-1]["messages"] == [{"role": "user", "content": "a prompt"}]
    parts = list(llm.stream_complete("another prompt"))
    assert "".join(p.delta or "" for p in parts) == parts[-1].text == "echo 1: another prompt"
    assert parts[-1].additional_kwargs["ttft_s"] is not None
    assert llm.predict(_prompt("q")) == "echo 1: q"


def _prompt(text):
    from llama_index.core.prompts import PromptTemplate

    return PromptTemplate(text)


def test_async_chat_stream_and_complete(fake):
    llm = make_llm(fake)

    async def run():
        chat = await llm.achat([user("one")])
        stream = await llm.astream_chat([user("one"), chat.message, user("two")])
        chunks = [r async for r in stream]
        comp = await llm.acomplete("three")
        cstream = await llm.astream_complete("four")
        cparts = [p async for p in cstream]
        await llm.aclose()
        return chat, chunks, comp, cparts

    chat, chunks, comp, cparts = asyncio.run(run())
    assert chat.message.content == "echo 1: one"
    assert chat.additional_kwargs["kvbranch"]["session_id"] == llm.session_id
    assert "".join(c.delta or "" for c in chunks) == "echo 3: two"
    assert chunks[-1].additional_kwargs["cached_tokens"] > 0
    assert comp.text == "echo 1: three"
    assert cparts[-1].text == "echo 1: four" and cparts[-1].additional_kwargs["ttft_s"]
    bodies = fake.chat_requests()
    assert all(b["session_id"] == llm.session_id for b in bodies)
    # sync and async share one server session
    assert fake.paths().count("POST /v1/kvbranch/sessions") == 1


def test_async_client_follows_the_event_loop(fake):
    llm = make_llm(fake)
    assert asyncio.run(llm.achat([user("a")])).message.content == "echo 1: a"
    assert asyncio.run(llm.achat([user("b")])).message.content == "echo 1: b"
    assert llm.chat([user("c")]).message.content == "echo 1: c"
    # a new loop re-attaches to the same server session (409 then GET), never a second one
    assert len(fake.sessions) == 1


def test_server_errors_propagate_as_sdk_errors(fake):
    llm = make_llm(fake)
    llm.chat([user("warm up")])
    fake.fail_next(400)
    with pytest.raises(BadRequestError):
        llm.chat([user("x")])
    fake.fail_next(400)
    with pytest.raises(BadRequestError):
        list(llm.stream_chat([user("x")]))


def test_extra_kwargs_reach_the_request_body(fake):
    llm = make_llm(fake, additional_kwargs={"top_k": 5})
    llm.chat(
        [user("x")],
        response_format={"type": "json_object"},
        stop=["\n"],
        seed=3,
        extra_body={"min_tokens": 1},
        verbose=True,
    )
    body = fake.chat_requests()[-1]
    assert body["top_k"] == 5 and body["min_tokens"] == 1
    assert body["response_format"] == {"type": "json_object"}
    assert body["stop"] == ["\n"] and body["seed"] == 3 and "verbose" not in body


def test_plain_server_runs_client_side(caplog):
    plain = Fake(kvbranch=False)
    llm = make_llm(plain)
    with caplog.at_level(logging.INFO, logger="kvbranch.sdk"):
        response = llm.chat([user("hi")])
    assert response.message.content == "echo 1: hi"
    body = plain.chat_requests()[-1]
    assert "session_id" not in body and "vllm_xargs" not in body
    assert response.additional_kwargs["kvbranch"] is None
    assert response.additional_kwargs["session_id"] is None
    child = llm.fork()
    assert child.chat([user("x")]).message.content == "echo 1: x"


# --- messages -----------------------------------------------------------------------------
def test_message_conversion():
    assistant = ChatMessage(
        role=MessageRole.ASSISTANT,
        blocks=[
            ToolCallBlock(tool_call_id="c1", tool_name="get_weather", tool_kwargs={"city": "Oslo"})
        ],
    )
    assert to_openai_message(assistant) == {
        "role": "assistant",
        "content": "",
        "tool_calls": [openai_call("c1", "get_weather", '{"city": "Oslo"}')],
    }
    # the model's own argument text wins over the blocks' parsed kwargs
    raw = ChatMessage(
        role="assistant",
        content="",
        additional_kwargs={"tool_calls": [openai_call("c2", "get_weather", '"Oslo"')]},
    )
    assert to_openai_message(raw)["tool_calls"][0]["function"]["arguments"] == '"Oslo"'
    tool = ChatMessage(
        role=MessageRole.TOOL,
        content="snow",
        additional_kwargs={"tool_call_id": "c1", "name": "get_weather"},
    )
    assert to_openai_message(tool) == {
        "role": "tool",
        "content": "snow",
        "tool_call_id": "c1",
        "name": "get_weather",
    }
    assert (
        to_openai_message(ChatMessage(role=MessageRole.DEVELOPER, content="x"))["role"] == "system"
    )
    two = ChatMessage(role="user", blocks=[TextBlock(text="a"), TextBlock(text="b")])
    assert to_openai_message(two) == {"role": "user", "content": "a\nb"}
    image = ChatMessage(
        role="user", blocks=[TextBlock(text="what is this?"), ImageBlock(url="http://img/x.png")]
    )
    assert to_openai_message(image)["content"] == [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": "http://img/x.png"}},
    ]


# --- tools --------------------------------------------------------------------------------
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TWO = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"],
}


@pytest.mark.parametrize(
    "text,schema,expected",
    [
        ('{"city": "Paris"}', SCHEMA, {"city": "Paris"}),
        ('"Paris"', SCHEMA, {"city": "Paris"}),  # guided decoding's bare value
        ("Paris", SCHEMA, {"city": "Paris"}),  # not JSON at all
        ('{"location": "Paris"}', SCHEMA, {"city": "Paris"}),  # one unknown key
        ('{"a": 1, "b": 2}', TWO, {"a": 1, "b": 2}),
        ("3", TWO, {}),  # no single parameter to map to
        ('{"a": 1}', TWO, {"a": 1}),  # partial but valid: left as is
        ("", SCHEMA, {}),
        ('{"city": "Paris"', SCHEMA, {"city": "Paris"}),  # a prefix of a streamed call
        ("42", None, {}),
    ],
)
def test_tool_kwargs(text, schema, expected):
    assert tool_kwargs(text, schema, partial=True) == expected


def test_resolve_tool_choice():
    assert resolve_tool_choice(None, False) == "auto"
    assert resolve_tool_choice(None, True) == "required"
    assert resolve_tool_choice("none", True) == "none"
    assert resolve_tool_choice("get_weather", False) == {
        "type": "function",
        "function": {"name": "get_weather"},
    }
    named = {"type": "function", "function": {"name": "x"}}
    assert resolve_tool_choice(named, False) is named


def test_prepare_chat_with_tools(fake):
    llm = make_llm(fake)
    kw = llm._prepare_chat_with_tools(
        [weather_tool],
        user_msg="weather in Paris?",
        chat_history=[ChatMessage(role="system", content="s")],
        tool_required=True,
    )
    assert [m.role for m in kw["messages"]] == [MessageRole.SYSTEM, MessageRole.USER]
    assert kw["tools"][0]["function"]["name"] == "get_weather"
    assert kw["tools"][0]["function"]["parameters"]["required"] == ["city"]
    assert kw["tool_choice"] == "required"
    named = llm._prepare_chat_with_tools([weather_tool], user_msg="x", tool_choice="get_weather")
    assert named["tool_choice"]["function"]["name"] == "get_weather"
    assert "tools" not in llm._prepare_chat_with_tools([], user_msg="x")


def test_strict_tools_default_leaves_strict_to_the_server(fake):
    llm = make_llm(fake)
    assert llm.strict_tools is None
    llm.chat_with_tools([weather_tool], user_msg="weather in Paris?", tool_required=True)
    body = fake.chat_requests()[-1]
    assert "strict" not in body["tools"][0]["function"]  # a kvbranch server marks it strict


@pytest.mark.parametrize("strict", [True, False])
def test_strict_tools_sets_every_spec(fake, strict):
    llm = make_llm(fake, strict_tools=strict)
    llm.chat_with_tools([weather_tool, add_tool], user_msg="x", tool_required=True)
    body = fake.chat_requests()[-1]
    assert [t["function"]["strict"] for t in body["tools"]] == [strict, strict]
    assert "strict" not in body  # consumed, not sent as a request parameter
    assert "strict" not in weather_tool.metadata.to_openai_tool()["function"]  # not mutated


def test_a_calls_strict_overrides_strict_tools(fake):
    llm = make_llm(fake, strict_tools=True)
    kw = llm._prepare_chat_with_tools([weather_tool], user_msg="x", strict=False)
    assert kw["tools"][0]["function"]["strict"] is False and "strict" not in kw
    loose = make_llm(fake)
    kw = loose._prepare_chat_with_tools([weather_tool], user_msg="x", strict=True)
    assert kw["tools"][0]["function"]["strict"] is True


def test_strict_tools_keeps_a_specs_own_strict_when_unset(fake):
    class LooseMetadata(ToolMetadata):
        def to_openai_tool(self, skip_length_check: bool = False) -> dict:
            spec = super().to_openai_tool(skip_length_check=skip_length_check)
            spec["function"]["strict"] = False
            return spec

    meta = weather_tool.metadata
    tool = FunctionTool.from_defaults(
        get_weather,
        tool_metadata=LooseMetadata(
            name=meta.name, description=meta.description, fn_schema=meta.fn_schema
        ),
    )
    kw = make_llm(fake)._prepare_chat_with_tools([tool], user_msg="x")
    assert kw["tools"][0]["function"]["strict"] is False
    kw = make_llm(fake, strict_tools=True)._prepare_chat_with_tools([tool], user_msg="x")
    assert kw["tools"][0]["function"]["strict"] is True


@pytest.mark.parametrize("arguments", ['{"city": "Paris"}', '"Paris"'])
def test_chat_with_tools_round_trip(arguments):
    fake = Fake(reply=tool_then_answer(arguments))
    llm = make_llm(fake)
    response = llm.chat_with_tools([weather_tool], user_msg="Weather in Paris?", tool_required=True)
    body = fake.chat_requests()[-1]
    assert body["tool_choice"] == "required" and body["tools"][0]["type"] == "function"
    calls = llm.get_tool_calls_from_response(response)
    assert [(c.tool_id, c.tool_name, c.tool_kwargs) for c in calls] == [
        ("call_1", "get_weather", {"city": "Paris"})
    ]
    # the history keeps what the model wrote; the tool result goes back with its call id
    tool_msg = ChatMessage(
        role="tool",
        content=get_weather(**calls[0].tool_kwargs),
        additional_kwargs={"tool_call_id": calls[0].tool_id},
    )
    final = llm.chat_with_tools(
        [weather_tool], chat_history=[user("Weather in Paris?"), response.message, tool_msg]
    )
    sent = fake.chat_requests()[-1]["messages"]
    assert sent[1]["tool_calls"][0]["function"]["arguments"] == arguments
    assert sent[2] == {"role": "tool", "content": "sunny, 21 C", "tool_call_id": "call_1"}
    assert final.message.content == "It is sunny, 21 C."
    # the branch history holds the tool call as it is sent back (content "", not null)
    assert llm.history[1] == {
        "role": "assistant",
        "content": "",
        "tool_calls": sent[1]["tool_calls"],
    }
    assert llm.get_tool_calls_from_response(final, error_on_no_tool_call=False) == []
    with pytest.raises(ValueError):
        llm.get_tool_calls_from_response(final)


def test_streamed_tool_calls_parse_at_every_step():
    fake = Fake(reply=tool_then_answer('{"a": 2, "b": 40}', name="add"))
    llm = make_llm(fake)
    responses = list(llm.stream_chat_with_tools([add_tool], user_msg="2+40?", tool_required=True))
    for r in responses:  # partial arguments never raise
        llm.get_tool_calls_from_response(r, error_on_no_tool_call=False)
    calls = llm.get_tool_calls_from_response(responses[-1])
    assert [(c.tool_name, c.tool_kwargs) for c in calls] == [("add", {"a": 2, "b": 40})]
    assert responses[-1].additional_kwargs["finish_reason"] == "tool_calls"
    assert responses[-1].message.additional_kwargs["tool_calls"][0]["id"] == "call_1"


def test_parallel_tool_calls_are_cut_to_one_unless_allowed():
    def reply(messages):
        return Reply(
            tool_calls=[
                FakeToolCall("get_weather", '{"city": "Paris"}', "c1"),
                FakeToolCall("get_weather", '{"city": "Oslo"}', "c2"),
            ]
        )

    llm = make_llm(Fake(reply=reply))
    one = llm.chat_with_tools([weather_tool], user_msg="both?")
    assert [c.tool_id for c in llm.get_tool_calls_from_response(one)] == ["c1"]
    assert len(one.message.additional_kwargs["tool_calls"]) == 1
    both = llm.chat_with_tools([weather_tool], user_msg="both?", allow_parallel_tool_calls=True)
    assert [c.tool_kwargs["city"] for c in llm.get_tool_calls_from_response(both)] == [
        "Paris",
        "Oslo",
    ]


def test_tool_calls_from_openai_style_additional_kwargs(fake):
    llm = make_llm(fake)
    calls_kwargs = {"tool_calls": [openai_call("x", "add", '{"a": 1, "b": 2}')]}
    response = ChatResponse(
        message=ChatMessage(role="assistant", content="", additional_kwargs=calls_kwargs)
    )
    calls = llm.get_tool_calls_from_response(response)
    assert [(c.tool_id, c.tool_kwargs) for c in calls] == [("x", {"a": 1, "b": 2})]


def test_predict_and_call(fake):
    fake.reply = tool_then_answer('"Oslo"')
    llm = make_llm(fake)
    out = llm.predict_and_call(
        [weather_tool], user_msg="Weather in Oslo?", tool_choice="get_weather"
    )
    assert out.response == "snow, -3 C"


# --- prefetch -----------------------------------------------------------------------------
def _prefetches(fake) -> list[str]:
    return [p for p in fake.paths() if p.endswith("/prefetch")]


def test_a_tool_call_prefetches_the_branch_in_the_background():
    fake = Fake(reply=tool_then_answer())
    llm = make_llm(fake)
    llm.chat_with_tools([weather_tool], user_msg="Weather?", tool_required=True)
    llm.wait_for_prefetch()
    assert _prefetches(fake) == [
        f"POST /v1/kvbranch/sessions/{llm.session_id}/branches/main/prefetch"
    ]
    fake.reply = lambda messages: Reply(content="prose")
    llm.chat([user("no tools")])
    llm.wait_for_prefetch()
    assert len(_prefetches(fake)) == 1  # prose answers do not prefetch
    quiet = make_llm(fake, prefetch_on_tool_call=False)
    quiet.chat_with_tools([weather_tool], user_msg="Weather?", tool_required=True)
    quiet.wait_for_prefetch()
    assert len(_prefetches(fake)) == 1


def test_async_tool_call_prefetches_in_a_task():
    fake = Fake(reply=tool_then_answer())
    llm = make_llm(fake)

    async def run():
        stream = await llm.astream_chat_with_tools(
            [weather_tool], user_msg="Weather?", tool_required=True
        )
        async for _ in stream:
            pass
        await llm.await_prefetch()

    asyncio.run(run())
    assert len(_prefetches(fake)) == 1


def test_a_failed_prefetch_never_raises(caplog):
    fake = Fake(reply=tool_then_answer())
    llm = make_llm(fake)
    with caplog.at_level(logging.INFO, logger="kvbranch.llamaindex"):
        fake.prefetch_failure = 500
        response = llm.chat_with_tools([weather_tool], user_msg="Weather?")
        llm.wait_for_prefetch()
        fake.prefetch_failure = httpx.ConnectError("down")

        async def run():
            await llm.achat_with_tools([weather_tool], user_msg="Weather?")
            await llm.await_prefetch()

        asyncio.run(run())
    assert llm.get_tool_calls_from_response(response)
    assert len(_prefetches(fake)) == 2
    assert caplog.text.count("prefetch of") == 2


# --- forks --------------------------------------------------------------------------------
def test_fork_binds_a_new_llm_to_a_new_branch(fake):
    llm = make_llm(fake)
    first = llm.chat([user("plan A")])
    child = llm.fork(branch_id="alt")
    assert isinstance(child, KVBranchLLM) and child is not llm
    assert child.branch_id == "alt" and child.session_id == llm.session_id
    assert llm.branch_id == "main"
    assert (
        child.history
        == llm.history
        == [
            {"role": "user", "content": "plan A"},
            {"role": "assistant", "content": first.message.content},
        ]
    )
    fork_body = [
        body
        for method, path, body, _ in fake.requests
        if path.endswith("/branches") and method == "POST"
    ][-1]
    assert fork_body["parent"] == "main" and fork_body["branch_id"] == "alt"
    assert fork_body["messages"] == llm.history
    child.chat([user("plan A"), first.message, user("plan B")])
    assert fake.chat_requests()[-1]["vllm_xargs"][BRANCH_XARG] == "alt"
    assert set(fake.sessions[llm.session_id]["branches"]) == {"main", "alt"}
    assert len(child.history) == 4 and len(llm.history) == 2
    # forking at a message, server-made branch id; duplicate ids are refused
    early = llm.fork(at_message=1)
    assert early.history == [{"role": "user", "content": "plan A"}]
    assert early.branch_id not in ("main", "alt")
    with pytest.raises(ValueError):
        llm.fork(branch_id="alt")
    assert child.branch.branch_id == "alt" and child.branch.messages == child.history


def test_afork_and_async_use_of_a_sync_fork(fake):
    llm = make_llm(fake)
    llm.chat([user("root")])
    sync_child = llm.fork(branch_id="s1")

    async def run():
        child = await llm.afork(branch_id="a1")
        await child.achat([user("from a1")])
        await sync_child.achat([user("from s1")])
        return child

    child = asyncio.run(run())
    assert child.branch_id == "a1"
    xargs = [b["vllm_xargs"][BRANCH_XARG] for b in fake.chat_requests()]
    assert xargs == ["main", "a1", "s1"]
    assert set(fake.sessions[llm.session_id]["branches"]) == {"main", "s1", "a1"}


def test_lost_server_state_is_restored_for_forks_and_prefetch():
    fake = Fake(reply=tool_then_answer())
    llm = make_llm(fake)
    llm.chat_with_tools([weather_tool], user_msg="Weather?", tool_required=True)
    llm.wait_for_prefetch()
    fake.lose_state()
    child = llm.fork(branch_id="after-restart")
    assert child.branch_id == "after-restart"
    assert set(fake.sessions[llm.session_id]["branches"]) == {"main", "after-restart"}
    assert llm.session.recoveries == 1


# --- agents -------------------------------------------------------------------------------
@pytest.mark.parametrize("streaming", [True, False])
def test_function_agent_round_trip(streaming):
    fake = Fake(reply=tool_then_answer('"Paris"'))
    llm = make_llm(fake, max_tokens=32)
    agent = FunctionAgent(
        tools=[get_weather],
        llm=llm,
        streaming=streaming,
        initial_tool_choice="get_weather",
        system_prompt="You answer weather questions with the tool.",
    )

    async def run():
        handler = agent.run("What is the weather in Paris?")
        results = [ev async for ev in handler.stream_events() if isinstance(ev, ToolCallResult)]
        answer = await handler
        await llm.await_prefetch()
        return results, answer

    results, answer = asyncio.run(run())
    assert [(r.tool_name, r.tool_kwargs, r.tool_output.content) for r in results] == [
        ("get_weather", {"city": "Paris"}, "sunny, 21 C")
    ]
    assert str(answer.response.content) == "It is sunny, 21 C."
    bodies = fake.chat_requests()
    assert len(bodies) == 2
    assert bodies[0]["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert bodies[1]["tool_choice"] == "auto"
    assert all(b["session_id"] == llm.session_id for b in bodies)
    assert [m["role"] for m in bodies[1]["messages"]] == ["system", "user", "assistant", "tool"]
    assert len(_prefetches(fake)) == 1
    # the second request continued the first one's cached sequence
    assert fake.sessions[llm.session_id]["branches"]["main"]["requests"] == 2
