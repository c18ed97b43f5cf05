"""OpenAI's cache hints (server/dialects/openai.py) through the registry: prompt_cache_key →
session, retention / options → pin lease, bad hints named. Pure logic; the real clients
against the real server are in tests/integration/keyed/test_dialects.py."""

from __future__ import annotations

import pytest

from sdk.contract import MAX_TTL_S, PIN_TTL_XARG, check_id
from server import dialects
from server.dialects.openai import OPENAI_PATHS
from tests.unit.server.dialects.bodies import CHAT, chat


@pytest.mark.parametrize("path", OPENAI_PATHS)
def test_prompt_cache_key_becomes_the_session(path):
    payload = chat(prompt_cache_key="user-42")
    hints = dialects.apply(payload, path)
    assert payload["session_id"] == "user-42" == hints.session_id
    assert PIN_TTL_XARG not in payload.get("vllm_xargs", {})


def test_a_key_that_is_not_an_id_gets_a_stable_digest_session():
    a, b = (
        chat(prompt_cache_key="alice@example.com/agent 1"),
        chat(prompt_cache_key="alice@example.com/agent 1"),
    )
    dialects.apply(a, CHAT)
    dialects.apply(b, CHAT)
    assert a["session_id"] == b["session_id"]
    assert a["session_id"].startswith("pck-")
    check_id(a["session_id"])
    other = chat(prompt_cache_key="alice@example.com/agent 2")
    dialects.apply(other, CHAT)
    assert other["session_id"] != a["session_id"]


@pytest.mark.parametrize("where", ["body", "header", "xargs"])
def test_an_explicit_session_wins_over_the_key(where):
    payload = chat(prompt_cache_key="k1")
    header = None
    if where == "body":
        payload["session_id"] = "mine"
    elif where == "header":
        header = "mine"
    else:
        payload["vllm_xargs"] = {"session_id": "mine"}
    hints = dialects.apply(payload, CHAT, header)
    assert hints.session_id is None
    assert payload.get("session_id") in (None, "mine")


@pytest.mark.parametrize(
    "value, seconds",
    [
        ("24h", 24 * 3600.0),
        ("30m", 1800.0),
        ("90s", 90.0),
        ("in_memory", None),
        ("in-memory", None),
        ("IN_MEMORY", None),
        (None, None),
    ],
)
def test_retention_becomes_the_pin_lease(value, seconds):
    payload = chat(prompt_cache_key="k", prompt_cache_retention=value)
    hints = dialects.apply(payload, CHAT)
    assert hints.pin_ttl_s == seconds
    assert payload.get("vllm_xargs", {}).get(PIN_TTL_XARG) == seconds


def test_cache_options_ttl_and_the_longer_of_two_hints():
    payload = chat(prompt_cache_options={"mode": "implicit", "ttl": "30m"})
    assert dialects.apply(payload, CHAT).pin_ttl_s == 1800.0
    payload = chat(prompt_cache_options={"ttl": "30m"}, prompt_cache_retention="24h")
    assert dialects.apply(payload, CHAT).pin_ttl_s == MAX_TTL_S


@pytest.mark.parametrize(
    "field, value, param",
    [
        ("prompt_cache_retention", "forever", "prompt_cache_retention"),
        ("prompt_cache_retention", "25h", "prompt_cache_retention"),
        ("prompt_cache_retention", "0m", "prompt_cache_retention"),
        ("prompt_cache_retention", 3600, "prompt_cache_retention"),
        ("prompt_cache_key", 42, "prompt_cache_key"),
        ("prompt_cache_key", "x" * 2000, "prompt_cache_key"),
        ("prompt_cache_options", "30m", "prompt_cache_options"),
        ("prompt_cache_options", {"ttl": "a week"}, "prompt_cache_options.ttl"),
        ("prompt_cache_options", {"mode": "sometimes"}, "prompt_cache_options.mode"),
    ],
)
def test_bad_openai_hints_are_named(field, value, param):
    found = dialects.problem(chat(**{field: value}), CHAT)
    assert found is not None and found[0] == param
    assert param in found[1]
    assert dialects.apply(chat(**{field: value}), CHAT).session_id is None


@pytest.mark.parametrize("key", ["\ud800", "ok\udfffok", "a" + "\udc00" * 3])
def test_a_lone_surrogate_cache_key_is_a_named_400_not_a_crash(key):
    found = dialects.problem(chat(prompt_cache_key=key), CHAT)
    assert found is not None and found[0] == "prompt_cache_key"
    assert "surrogate" in found[1]
    found[1].encode("utf-8")  # the message itself is encodable
    assert dialects.apply(chat(prompt_cache_key=key), CHAT).session_id is None
