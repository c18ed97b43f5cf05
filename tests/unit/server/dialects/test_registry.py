"""The dialect registry (server/dialects/registry.py): which dialect speaks a route, that a
route none speaks is left alone, that a bug in a dialect never escapes, that adding a dialect
is one entry, and :func:`session_of` — the session the instance gives a request, which the
P/D router keys its turns by (explicit first, in vLLM's order; else the derived one)."""

from __future__ import annotations

import json

import pytest

from sdk.contract import PIN_TTL_XARG, SESSION_XARG
from server import dialects
from server.dialects import anthropic as anthropic_dialect
from server.dialects import registry
from server.dialects.base import DialectError, Hints
from tests.unit.server.dialects.bodies import CHAT, MESSAGES, anthropic, chat, conversation


def test_each_route_has_one_dialect():
    assert dialects.dialect_for(CHAT).name == "openai"
    assert dialects.dialect_for("/v1/completions").name == "openai"
    assert dialects.dialect_for("/v1/responses").name == "openai"
    assert dialects.dialect_for(MESSAGES).name == "anthropic"
    assert dialects.dialect_for("/v1/chat/completions/batch") is None
    assert [d.name for d in dialects.DIALECTS] == ["openai", "anthropic"]


def test_other_routes_are_untouched():
    payload = chat(prompt_cache_key="k", prompt_cache_retention="forever")
    before = json.loads(json.dumps(payload))
    assert dialects.problem(payload, "/v1/chat/completions/batch") is None
    dialects.apply(payload, "/inference/v1/generate")
    assert payload == before
    assert dialects.session_of(payload, "/inference/v1/generate", None) is None


def test_a_bug_in_the_hints_never_escapes(monkeypatch):
    def broken(*_a, **_k):
        raise KeyError("bug")

    monkeypatch.setattr(anthropic_dialect, "breakpoints", broken)
    payload = anthropic(cache_control={"type": "ephemeral"})
    assert dialects.problem(payload, MESSAGES) is None
    assert dialects.apply(payload, MESSAGES).session_id is None
    assert dialects.session_of(payload, MESSAGES, None) is None


class _Echo:
    """A dialect in one class: ``x_cache`` names the session, ``x_ttl_s`` the lease."""

    name = "echo"
    paths = ("/v1/echo",)
    session_field = False

    def check(self, payload: dict) -> None:
        if not isinstance(payload.get("x_cache", ""), str):
            raise DialectError("x_cache", "x_cache must be a string")

    def hints(self, payload: dict, own_session: bool) -> Hints:
        self.check(payload)
        own = None if own_session else payload.get("x_cache") or None
        return Hints(session_id=own, pin_ttl_s=payload.get("x_ttl_s"))


def test_adding_a_dialect_is_one_entry(monkeypatch):
    monkeypatch.setattr(registry, "DIALECTS", (*registry.DIALECTS, _Echo()))
    assert dialects.problem({"x_cache": 1}, "/v1/echo") == ("x_cache", "x_cache must be a string")
    payload = {"x_cache": "e1", "x_ttl_s": 60.0}
    hints = dialects.apply(payload, "/v1/echo")
    assert hints.session_id == "e1"
    assert payload["vllm_xargs"] == {SESSION_XARG: "e1", PIN_TTL_XARG: 60.0}
    assert dialects.session_of({"x_cache": "e1"}, "/v1/echo", None) == "e1"
    assert dialects.session_of({"x_cache": "e1"}, "/v1/echo", "mine") == "mine"


# --- session_of: what the router keys a turn by ----------------------------------------------
def test_session_of_a_prompt_cache_key_is_the_instances_session():
    for key in ("agent-42", "alice@example.com/agent 1"):
        payload = chat(prompt_cache_key=key)
        routed = dialects.session_of(payload, CHAT, None)
        assert "session_id" not in payload  # the router's copy is not changed
        dialects.apply(payload, CHAT)  # what the instance does with the same body
        assert routed == payload["session_id"]
    assert dialects.session_of(chat(prompt_cache_key="agent-42"), CHAT, None) == "agent-42"
    digest = dialects.session_of(chat(prompt_cache_key="a b"), CHAT, None)
    assert digest is not None and digest.startswith("pck-")


def test_session_of_breakpoints_is_the_instances_session():
    sessions = set()
    for request in conversation(3):
        routed = dialects.session_of(request, MESSAGES, None)
        dialects.apply(request, MESSAGES)
        assert routed == request["vllm_xargs"][SESSION_XARG]
        sessions.add(routed)
    (session,) = sessions  # one conversation, one session, on the router as on the instance
    assert session.startswith("cc-")
    assert dialects.session_of(anthropic(), MESSAGES, None) is None  # no breakpoint


@pytest.mark.parametrize(
    "path, payload, header, expected",
    [
        (CHAT, chat(session_id="body", prompt_cache_key="k"), "head", "body"),
        (CHAT, chat(prompt_cache_key="k"), "head", "head"),
        (CHAT, chat(prompt_cache_key="k", vllm_xargs={SESSION_XARG: "xa"}), None, "xa"),
        (CHAT, chat(session_id="body", vllm_xargs={SESSION_XARG: "xa"}), "head", "body"),
        (CHAT, chat(session_id="", prompt_cache_key="k"), None, "k"),
        # /v1/messages has no session_id field: a body one is not the request's session
        (MESSAGES, anthropic(session_id="body"), None, None),
        (MESSAGES, anthropic(cache_control={"type": "ephemeral"}), "head", "head"),
        (MESSAGES, anthropic(vllm_xargs={SESSION_XARG: "xa"}), None, "xa"),
        # a route without a dialect: only explicit sessions (as the router always read them)
        ("/v1/other", {"session_id": "body", "prompt_cache_key": "k"}, None, "body"),
    ],
)
def test_an_explicit_session_wins_in_vllms_order(path, payload, header, expected):
    assert dialects.session_of(payload, path, header) == expected


def test_a_bad_hint_derives_no_session():
    assert dialects.session_of(chat(prompt_cache_key=42), CHAT, None) is None
    bad = anthropic(cache_control={"type": "ephemeral", "ttl": "2h"})
    assert dialects.session_of(bad, MESSAGES, None) is None
    # an explicit session is still read (the instance refuses the body anyway)
    assert dialects.session_of(chat(prompt_cache_key=42), CHAT, "mine") == "mine"
