"""sdk.conversation against the sdk's fake server, each behaviour once per driver: the ``mode``
fixture calls a :class:`Conversation` method (``chat``, ``fork``, ...) directly, or its async
twin (``achat``, ``afork``, ...) on one event loop per test."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from sdk import NO_RETRY, BadRequestError
from sdk.contract import BRANCH_XARG
from sdk.conversation import (
    BranchRef,
    ClientSet,
    Conversation,
    SessionSettings,
    answer_message,
    coerce_id,
)
from sdk.testing import FakeKVBranchServer, FakeToolCall, Reply, default_reply

SID = "conv-1"


class Mode:
    """Runs a conversation's sync methods, or their ``a``-prefixed async twins on one loop."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.loop = asyncio.new_event_loop()

    def __call__(self, conv: Conversation, name: str, *args: Any, **kwargs: Any) -> Any:
        if self.kind == "sync":
            return getattr(conv, name)(*args, **kwargs)
        return self.loop.run_until_complete(getattr(conv, "a" + name)(*args, **kwargs))

    def read(self, stream: Any) -> list[Any]:
        """Every chunk of a stream opened by ``chat_stream``."""
        if self.kind == "sync":
            with stream:
                return list(stream)

        async def drain() -> list[Any]:
            async with stream:
                return [chunk async for chunk in stream]

        return self.loop.run_until_complete(drain())

    def settle(self, conv: Conversation) -> None:
        """Wait for the background prefetches this mode starts."""
        if self.kind == "sync":
            conv.wait_prefetches(5.0)
        else:
            self.loop.run_until_complete(conv.await_prefetches(5.0))


@pytest.fixture(params=["sync", "async"])
def mode(request: pytest.FixtureRequest) -> Iterator[Mode]:
    made = Mode(request.param)
    yield made
    made.loop.close()


def conversation(fake: FakeKVBranchServer, *, owned: bool = False, **kwargs: Any) -> Conversation:
    clients = ClientSet(
        "http://fake",
        model=fake.model,
        retry=NO_RETRY,
        transport=fake.transport(),
        async_transport=fake.transport(),
    )
    settings = SessionSettings(SID) if owned else None
    return Conversation(clients, session=settings, **kwargs)


def ids_of(body: dict[str, Any]) -> tuple[Any, Any]:
    return body.get("session_id"), (body.get("vllm_xargs") or {}).get(BRANCH_XARG)


def forks(fake: FakeKVBranchServer) -> list[dict[str, Any]]:
    return [
        body
        for method, path, body, _ in fake.requests
        if method == "POST" and path.endswith("/branches")
    ]


def prefetches(fake: FakeKVBranchServer) -> list[str]:
    return [p for p in fake.paths() if p.endswith("/prefetch")]


def tool_reply(messages: list[dict[str, Any]]) -> Reply:
    if messages[-1]["role"] == "tool":
        return default_reply(messages)
    return Reply(tool_calls=[FakeToolCall("get_weather", '{"city": "Paris"}', id="")])


USER = [{"role": "user", "content": "plan the trip"}]


# --- ids ------------------------------------------------------------------------------------
def test_coerce_id_and_branch_ref() -> None:
    assert coerce_id(None) is None and coerce_id("") is None
    assert coerce_id("thread 1/ä") == "thread-1--"
    assert coerce_id("-x") == "x-x" and coerce_id(42, "ckpt-") == "ckpt-42"
    assert len(coerce_id("a" * 300) or "") == 128
    assert BranchRef().ids() == {}
    assert BranchRef("s").ids() == {"session_id": "s"} and BranchRef("s").branch == "main"
    assert BranchRef("s", "b").ids() == {"session_id": "s", "branch_id": "b"}


def test_answer_message_is_what_goes_back_to_the_server() -> None:
    from sdk import ChatResult, ToolCall

    plain = ChatResult(id=None, model=None, text="hi")
    assert answer_message(plain) == {"role": "assistant", "content": "hi"}
    call = ChatResult(
        id=None, model=None, text="", tool_calls=(ToolCall(id="", name="f", arguments="{}"),)
    )
    assert answer_message(call) == {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": "call_0", "type": "function", "function": {"name": "f", "arguments": "{}"}}
        ],
    }


def test_chat_names_only_the_ids_it_has(mode: Mode) -> None:
    fake = FakeKVBranchServer()
    conv = conversation(fake)
    result, ids = mode(conv, "chat", BranchRef(), USER, max_tokens=8)
    assert ids == {} and ids_of(fake.chat_requests()[-1]) == (None, None)
    assert result.text == "echo 1: plan the trip"
    assert fake.chat_requests()[-1]["max_tokens"] == 8
    _, ids = mode(conv, "chat", BranchRef("s1"), USER)
    assert ids == {"session_id": "s1"} and ids_of(fake.chat_requests()[-1]) == ("s1", None)
    _, ids = mode(conv, "chat", BranchRef("s1", "b1"), USER)
    assert ids_of(fake.chat_requests()[-1]) == ("s1", "b1")
    assert "POST /v1/kvbranch/sessions" not in fake.paths()  # named: the server makes it


def test_a_plain_server_gets_plain_requests(mode: Mode) -> None:
    fake = FakeKVBranchServer(kvbranch=False, reply=tool_reply)
    conv = conversation(fake)
    with pytest.warns(RuntimeWarning):
        result, ids = mode(conv, "chat", BranchRef("s1", "b1"), USER)
    assert ids == {} and ids_of(fake.chat_requests()[-1]) == (None, None)
    assert result.tool_calls  # no prefetch without kvbranch
    mode.settle(conv)
    assert prefetches(fake) == []
    assert mode(conv, "pin", BranchRef("s1"), 60) is None
    assert mode(conv, "info", BranchRef("s1")) is None


def test_server_errors_reach_the_caller(mode: Mode) -> None:
    fake = FakeKVBranchServer()
    conv = conversation(fake)
    fake.fail_next(400)
    with pytest.raises(BadRequestError):
        mode(conv, "chat", BranchRef("s1"), USER)
    with pytest.raises(ValueError):
        mode(conv, "pin", BranchRef(), 60)


# --- prefetch -------------------------------------------------------------------------------
def test_a_tool_call_prefetches_the_branch_in_the_background(mode: Mode) -> None:
    fake = FakeKVBranchServer(reply=tool_reply)
    conv = conversation(fake)
    mode(conv, "chat", BranchRef("s1", "b1"), USER)
    mode.settle(conv)
    assert prefetches(fake) == ["POST /v1/kvbranch/sessions/s1/branches/b1/prefetch"]
    mode(conv, "chat", BranchRef("s1", "b1"), USER, prefetch_on_tool_call=False)
    mode(conv, "chat", BranchRef(), USER)  # no session: nothing to prefetch
    mode.settle(conv)
    assert len(prefetches(fake)) == 1


def test_a_streamed_tool_call_prefetches_once_the_stream_is_read(mode: Mode) -> None:
    fake = FakeKVBranchServer(reply=tool_reply)
    conv = conversation(fake)
    stream, ids = mode(conv, "chat_stream", BranchRef("s2"), USER)
    assert ids == {"session_id": "s2"} and prefetches(fake) == []
    chunks = mode.read(stream)
    assert any(c.tool_calls for c in chunks) and stream.result.tool_calls
    mode.settle(conv)
    assert prefetches(fake) == ["POST /v1/kvbranch/sessions/s2/branches/main/prefetch"]


class PrefetchFailingServer(FakeKVBranchServer):
    def handle(self, request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/prefetch"):
            self.requests.append((request.method, request.url.path, None, request.headers))
            return self._error(500, "injected")
        return super().handle(request)


def test_a_failed_prefetch_is_logged_never_raised(
    mode: Mode, caplog: pytest.LogCaptureFixture
) -> None:
    fake = PrefetchFailingServer(reply=tool_reply)
    conv = conversation(fake, logger=logging.getLogger("test.conversation"))
    with caplog.at_level(logging.INFO, logger="test.conversation"):
        result, _ = mode(conv, "chat", BranchRef("s1"), USER)
        mode.settle(conv)
    assert result.tool_calls and len(prefetches(fake)) == 1
    assert "prefetch of s1/main failed" in caplog.text


# --- named sessions: forks ------------------------------------------------------------------
def test_fork_at_once_when_the_parent_exists(mode: Mode) -> None:
    fake = FakeKVBranchServer()
    conv = conversation(fake)
    mode(conv, "chat", BranchRef("s1"), USER)
    child = mode(conv, "fork", BranchRef("s1"), "alt", at_messages=USER)
    assert child == BranchRef("s1", "alt", fork_parent="main")
    assert forks(fake)[-1] == {"parent": "main", "branch_id": "alt", "messages": USER}
    assert fake.sessions["s1"]["branches"]["alt"]["fork_offset_tokens"] > 0
    n = len(fake.paths())
    mode(conv, "chat", child, USER)  # made already: no second fork at its first call
    assert fake.paths()[n:] == ["POST /v1/chat/completions"]
    assert ids_of(fake.chat_requests()[-1]) == ("s1", "alt")
    mode(conv, "fork", BranchRef("s1"), "end")  # no messages: at the parent's end
    assert forks(fake)[-1] == {"parent": "main", "branch_id": "end"}


def test_fork_lazily_when_the_parent_is_not_there_yet(mode: Mode) -> None:
    fake = FakeKVBranchServer()
    conv = conversation(fake)
    child = mode(conv, "fork", BranchRef("s3"), "later")  # 404: no session s3 yet
    assert child.fork_parent == "main" and "later" not in fake.sessions.get("s3", {})
    mode(conv, "chat", BranchRef("s3"), USER)  # the thread's main
    mode(conv, "chat", child, USER + [{"role": "user", "content": "by train"}])
    body = forks(fake)[-1]
    assert body["branch_id"] == "later" and body["messages"][0] == USER[0]
    assert fake.sessions["s3"]["branches"]["later"]["parent"] == "main"
    n = len(forks(fake))
    mode(conv, "chat", child, USER)
    assert len(forks(fake)) == n  # forked once only


def test_fork_without_a_session_is_lazy_and_local(mode: Mode) -> None:
    fake = FakeKVBranchServer()
    conv = conversation(fake)
    child = mode(conv, "fork", BranchRef(), "b")
    assert child == BranchRef(None, "b", fork_parent="main") and fake.requests == []


def test_a_fork_the_server_cannot_render_forks_without_a_shared_prefix(mode: Mode) -> None:
    fake = FakeKVBranchServer()
    conv = conversation(fake)
    mode(conv, "chat", BranchRef("s4"), USER)
    fake.fail_next(400)  # what a server whose chat template cannot render the messages says
    mode(conv, "fork", BranchRef("s4"), "b400", at_messages=USER)
    assert forks(fake)[-2]["messages"] == USER
    assert forks(fake)[-1] == {"parent": "main", "branch_id": "b400", "token_offset": 0}
    assert fake.sessions["s4"]["branches"]["b400"]["parent"] == "main"
    fake.fail_next(400)
    mode(conv, "fork", BranchRef("s4"), "b400", at_messages=USER)  # 400, then 409: fine


# --- named sessions: hooks ------------------------------------------------------------------
def test_pin_unpin_prefetch_info_and_delete(mode: Mode) -> None:
    fake = FakeKVBranchServer()
    conv = conversation(fake)
    ref = BranchRef("s5")
    mode(conv, "chat", ref, USER)
    assert mode(conv, "pin", ref, 120).pinned
    assert mode(conv, "unpin", ref).pinned is False
    assert mode(conv, "prefetch", ref).session_id == "s5"
    assert mode(conv, "info", ref).branch_id == "main"
    mode(conv, "delete_session", "s5")
    assert "s5" not in fake.sessions
    mode(conv, "delete_session", "s5")  # already gone: fine


# --- an owned session -----------------------------------------------------------------------
def test_owned_session_is_created_once_and_keeps_the_last_exchange(mode: Mode) -> None:
    fake = FakeKVBranchServer(reply=tool_reply)
    conv = conversation(fake, owned=True)
    ref = BranchRef(SID, "main")
    result, ids = mode(conv, "chat", ref, USER)
    assert ids == {"session_id": SID, "branch_id": "main"}
    assert conv.last_exchange("main") == USER + [answer_message(result)]
    assert conv.last_exchange("main")[-1]["content"] == ""  # beside tool calls, not null
    stream, _ = mode(conv, "chat_stream", ref, USER + [answer_message(result)])
    mode.read(stream)
    assert conv.last_exchange("main")[-1] == answer_message(stream.result)
    assert fake.paths().count("POST /v1/kvbranch/sessions") == 1
    assert mode(conv, "branch", "main").messages == conv.last_exchange("main")
    assert mode(conv, "session").session_id == SID
    # a named session beside the owned one keeps no last exchange
    mode(conv, "chat", BranchRef("other"), USER)
    assert conv.last_exchange("other") == []


def test_owned_fork_cuts_the_last_exchange(mode: Mode) -> None:
    fake = FakeKVBranchServer()
    conv = conversation(fake, owned=True)
    main = BranchRef(SID, "main")
    result, _ = mode(conv, "chat", main, USER)
    child = mode(conv, "fork_owned", main, branch_id="alt")
    assert child == BranchRef(SID, "alt")
    assert conv.last_exchange("alt") == conv.last_exchange("main")
    assert forks(fake)[-1]["messages"] == conv.last_exchange("main")
    early = mode(conv, "fork_owned", main, 1)
    assert conv.last_exchange(early.branch_id) == USER
    with pytest.raises(ValueError):
        mode(conv, "fork_owned", main, branch_id="alt")
    _, ids = mode(conv, "chat", child, USER + [answer_message(result)])
    assert ids == {"session_id": SID, "branch_id": "alt"}
    assert set(fake.sessions[SID]["branches"]) == {"main", "alt", early.branch_id}


def test_owned_session_is_restored_when_the_server_lost_it(mode: Mode) -> None:
    fake = FakeKVBranchServer()
    conv = conversation(fake, owned=True)
    main = BranchRef(SID, "main")
    mode(conv, "chat", main, USER)
    fake.lose_state()
    mode(conv, "fork_owned", main, branch_id="after")
    assert set(fake.sessions[SID]["branches"]) == {"main", "after"}
    assert mode(conv, "session").recoveries == 1
    fake.lose_state()
    assert mode(conv, "prefetch", main).session_id == SID  # restored again, then prefetched
    mode(conv, "delete_session", SID)
    assert SID not in fake.sessions and conv.last_exchange("main") == []


def test_sync_and_async_share_the_owned_branches() -> None:
    fake = FakeKVBranchServer()
    conv = conversation(fake, owned=True)
    main = BranchRef(SID, "main")
    conv.chat(main, USER)
    child = conv.fork_owned(main, branch_id="s1")

    async def run() -> None:
        await conv.achat(child, USER)
        other = await conv.afork_owned(main, branch_id="a1")
        assert (await conv.abranch("s1")).messages == conv.last_exchange("s1")
        await conv.achat(other, USER)
        await conv.aclose()

    asyncio.run(run())
    xargs = [ids_of(b)[1] for b in fake.chat_requests()]
    assert xargs == ["main", "s1", "a1"]
    assert fake.paths().count("POST /v1/kvbranch/sessions") == 2  # per client: 201, then 409


# --- clients --------------------------------------------------------------------------------
def test_client_set_one_async_client_per_live_loop() -> None:
    fake = FakeKVBranchServer()
    clients = ClientSet("http://fake", transport=fake.transport(), async_transport=fake.transport())

    async def current() -> Any:
        return clients.current(), clients.current()

    first, again = asyncio.run(current())
    assert first is again
    second, _ = asyncio.run(current())
    assert first is not second
    assert all(not loop.is_closed() for loop in clients.loops())
    sync = clients.sync
    clients.close()
    assert clients.sync is not sync
