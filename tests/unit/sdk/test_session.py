"""Sessions and branches over the fake server: client-side history, forks, recovery when the
server lost its state, and plain OpenAI-compatible servers."""

from __future__ import annotations

import warnings

import pytest

from sdk import (
    NO_RETRY,
    ConflictError,
    ServerError,
    StreamInterruptedError,
)
from sdk.contract import BRANCH_XARG
from sdk.testing import FakeKVBranchServer, FakeToolCall, Reply


@pytest.fixture
def fake():
    return FakeKVBranchServer()


@pytest.fixture
def client(driver, fake):
    return driver.client(
        "http://fake", transport=fake.transport(), model="fake-model", retry=NO_RETRY
    )


def test_turns_keep_history_and_send_identity(fake, client):
    session = client.session(system="be brief")
    main = session.main
    first = main.chat("one", temperature=0)
    second = main.chat("two")
    assert first.text == "echo 2: one" and second.text == "echo 4: two"
    assert main.messages == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "one"},
        {"role": "assistant", "content": "echo 2: one"},
        {"role": "user", "content": "two"},
        {"role": "assistant", "content": "echo 4: two"},
    ]
    body = fake.chat_requests()[-1]
    assert body["session_id"] == session.session_id
    assert body["vllm_xargs"] == {BRANCH_XARG: "main"}
    assert body["messages"] == main.messages[:-1]  # the full history is re-sent
    assert second.split.device_hit_tokens > 0
    assert "POST /v1/kvbranch/sessions" in fake.paths()


def test_messages_is_a_copy(client):
    main = client.session().main
    main.chat("x")
    main.messages[0]["content"] = "changed"
    assert main.messages[0]["content"] == "x"


def test_failed_turn_leaves_history_unchanged(fake, client):
    main = client.session().main
    main.chat("one")
    before = main.messages
    fake.fail_next(500)
    with pytest.raises(ServerError):
        main.chat("two")
    assert main.messages == before


def test_stream_commits_only_a_finished_answer(fake, client):
    main = client.session().main
    stream = main.chat_stream("one")
    assert len(main) == 0
    assert "".join(c.content or "" for c in stream) == "echo 1: one"
    assert main.messages[-1] == {"role": "assistant", "content": "echo 1: one"}
    fake.break_next_stream(after_events=2)
    with pytest.raises(StreamInterruptedError):
        for _ in main.chat_stream("two"):
            pass
    assert len(main) == 2


def test_tool_call_turn_and_tool_result(fake, client):
    calls = [FakeToolCall("lookup", '{"q": "x"}', id="call_1")]
    fake.reply = lambda m: (
        Reply(tool_calls=calls)
        if m[-1]["role"] == "user"
        else Reply(content=f"got {m[-1]['content']}")
    )
    main = client.session().main
    result = main.chat("find x", tools=[{"type": "function", "function": {"name": "lookup"}}])
    assert result.finish_reason == "tool_calls" and result.tool_calls[0].name == "lookup"
    assert main.messages[-1]["tool_calls"][0]["id"] == "call_1"
    assert main.prefetch().status == "scheduled"
    main.add_tool_result("call_1", "42")
    assert main.chat().text == "got 42"
    assert [m["role"] for m in main.messages] == ["user", "assistant", "tool", "assistant"]
    with pytest.raises(TypeError, match="json.dumps"):
        main.add_tool_result("call_1", {"not": "a string"})


def test_fork_at_message_index(fake, client):
    session = client.session(system="sys")
    main = session.main
    main.chat("one")
    main.chat("two")
    child = main.fork(at_message=3, branch_id="alt")
    assert child.messages == main.messages[:3] and child.parent_id == "main"
    assert child.fork_index == 3 and session.branch("alt") is child
    fork_body = fake.requests[-1][2]
    assert fork_body == {"parent": "main", "branch_id": "alt", "messages": main.messages[:3]}
    assert fake.sessions[session.session_id]["branches"]["alt"]["fork_offset_tokens"] > 0
    answer = child.chat("three")
    assert answer.text == "echo 4: three" and len(main) == 5 and len(child) == 5
    assert fake.chat_requests()[-1]["vllm_xargs"] == {BRANCH_XARG: "alt"}
    # the default fork point is the current end; negative indexes count from the end
    assert main.fork().messages == main.messages
    assert main.fork(-2).messages == main.messages[:-2]
    with pytest.raises(IndexError, match="outside"):
        main.fork(at_message=6)
    with pytest.raises(ValueError, match="already exists"):
        main.fork(branch_id="alt")
    with pytest.raises(ValueError, match="branch_id must be"):
        main.fork(branch_id="no spaces please")


def test_fork_falls_back_when_the_server_cannot_render_messages(fake, client):
    main = client.session().main
    main.chat("one")
    fake.fail_next(
        400,
        body={
            "error": {
                "message": "messages could not be rendered with the chat template",
                "type": "BadRequestError",
                "code": 400,
            }
        },
    )
    child = main.fork(at_message=1, branch_id="b")
    assert fake.requests[-1][2] == {"parent": "main", "branch_id": "b", "token_offset": 0}
    assert child.messages == main.messages[:1]


def test_recovery_after_the_server_lost_everything(fake, client):
    session = client.session("sess-1", system="sys", pin_ttl_s=120)
    main = session.main
    main.chat("one")
    child = main.fork(branch_id="alt")
    child.pin(600)
    before = child.chat("two").text

    fake.lose_state()  # restart
    child.prefetch()  # 404 -> recreate session and branch, then repeat
    assert session.recoveries == 1
    restored = fake.sessions["sess-1"]
    assert restored["pin_ttl_s"] == 120
    assert restored["branches"]["alt"]["pinned"]  # the explicit pin was re-applied
    # the conversation continues; the same history gives the same answer
    assert child.fork(at_message=-2).chat("two").text == before


def test_recovery_of_pin_and_fork_after_expiry(fake, client):
    session = client.session("sess-2")
    main = session.main
    main.chat("one")
    fake.lose_state()
    info = main.pin(30)
    assert info.pinned and session.recoveries == 1
    fake.lose_state()
    child = main.fork(at_message=1)
    assert child.branch_id in fake.sessions["sess-2"]["branches"]
    assert session.recoveries == 2


def test_existing_session_id_is_attached(fake, client):
    client.create_session("shared")
    session = client.session("shared")
    assert session.session_id == "shared"
    assert fake.paths()[-1] == "GET /v1/kvbranch/sessions/shared"


def test_pin_conflict_is_raised(fake, client):
    main = client.session().main
    fake.fail_next(
        409,
        body={
            "error": {
                "message": "pin refused: the pin budget is full",
                "type": "ConflictError",
                "code": 409,
            }
        },
    )
    with pytest.raises(ConflictError, match="pin budget"):
        main.pin(60)
    assert main.pin_ttl_s is None
    with pytest.raises(ValueError, match="greater than 0"):
        main.pin(0)


def test_delete_branch_and_session(fake, client):
    session = client.session()
    child = session.main.fork(branch_id="x")
    child.delete()
    assert "x" not in session.branches
    assert "x" not in fake.sessions[session.session_id]["branches"]
    with pytest.raises(ValueError, match="main branch cannot be deleted"):
        session.main.delete()
    session.delete()
    assert session.session_id not in fake.sessions and session.branches == {}


def test_plain_openai_server_one_warning_client_side_only(driver):
    fake = FakeKVBranchServer(kvbranch=False)
    client = driver.client("http://fake", transport=fake.transport(), model="fake-model")
    with pytest.warns(RuntimeWarning, match="no kvbranch routes") as caught:
        session = client.session(system="sys")
        main = session.main
        main.chat("one")
        child = main.fork(at_message=1)
        assert child.chat("two").text == "echo 2: two"
        assert main.pin(60) is None and main.prefetch() is None and main.info() is None
        assert session.info() is None
        session.delete()
    assert len([w for w in caught if "no kvbranch routes" in str(w.message)]) == 1
    for body in fake.chat_requests():
        assert "session_id" not in body and "vllm_xargs" not in body
    assert child.messages[-1]["content"] == "echo 2: two"
    # only the health probe went to a kvbranch route
    assert [p for p in fake.paths() if "kvbranch" in p] == ["GET /v1/kvbranch/health"]


def test_kvbranch_false_skips_the_probe_silently(driver):
    fake = FakeKVBranchServer()
    client = driver.client(
        "http://fake", transport=fake.transport(), model="fake-model", kvbranch=False
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        client.session().main.chat("x")
    assert not [p for p in fake.paths() if "kvbranch" in p]


def test_bad_turn_input(driver):
    fake = FakeKVBranchServer()
    main = (
        driver.client("http://fake", transport=fake.transport(), model="fake-model").session().main
    )
    with pytest.raises(ValueError, match="nothing to send"):
        main.chat()
    with pytest.raises(ValueError, match="no 'role'"):
        main.chat({"content": "x"})
    with pytest.raises(TypeError, match="at_message"):
        main.fork(at_message="1")
    with pytest.raises(ValueError, match="session_id must be"):
        driver.client("http://fake", transport=fake.transport()).session("bad id")
    assert len(main) == 0


def test_session_flow_and_recovery(fake, client):
    session = client.session("a-1", system="sys")
    main = session.main
    main.chat("one")
    stream = main.chat_stream("two")
    text = "".join(c.content or "" for c in stream)
    child = main.fork(at_message=3, branch_id="alt")
    child.pin(60)
    fake.lose_state()
    prefetch = child.prefetch()
    answer = child.chat("three")
    info = child.info()
    assert session.info().session_id == "a-1"
    child.unpin()
    assert not child.info().pinned
    session.delete()
    assert text == "echo 4: two" and main.messages[-1]["content"] == text
    assert child.messages[:3] == main.messages[:3] and answer.text == "echo 4: three"
    assert session.recoveries == 1 and prefetch is not None and info.pinned
    assert "a-1" not in fake.sessions


def test_unknown_session_and_fork_keywords_are_type_errors(fake, client):
    with pytest.raises(TypeError, match="pin_ttl"):
        client.session(pin_ttl=30)
    with pytest.raises(TypeError, match="offset"):
        client.fork_branch("s", offset=3)
    assert not [p for p in fake.paths() if p.startswith("POST /v1/kvbranch/sessions")]
