"""Prefill/decode disaggregation with real instances on loopback: a prefill instance, a decode
instance (each on its own core, KV over NIXL/UCX) and the router, all real processes.

Greedy answers through the router must equal a single plain vLLM instance's, turn by turn, and
from turn 2 P must pull the conversation from D (remote hits) and recompute only the new tokens.
The kill tests run last in this module: they stop instances.
"""

from __future__ import annotations

import json

import httpx
import pytest

from sdk import KVBranchClient
from tests import prestart
from tests.integration.helpers import (
    chat,
    chat_body,
    client,
    pd_activity,
    pd_instance,
    size_args,
    system_prompt,
    text_of,
)
from tests.server_process import ServerProcess

INSTANCE_ARGS = [*size_args(0.5, 0.25, 4096), "--pd-hold-ttl-s", "120"]
MAX_TOKENS = 16


class Cluster:
    """P and D (launched ahead of the module: :mod:`tests.prestart`) and a router in front."""

    def __init__(self, prefill: ServerProcess, decode: ServerProcess) -> None:
        self.prefill = prefill
        self.decode = decode
        legs = ["--prefill", prefill.url, "--decode", decode.url]
        # Every turn through P (these tests check the pull): the D holding a branch would serve
        # a turn alone whenever P happened to be busier (docs/pd.md, decode-local).
        policy = ["--router-policy", "always-split"]
        args = ["--role", "router", *legs, *policy, "--pd-hold-ttl-s", "120"]
        self.router = ServerProcess(args, name="router", ready_timeout=120)


pd_instances = prestart.fixture(
    "pd_instances",
    lambda: (
        pd_instance(INSTANCE_ARGS, "prefill", "0", name="prefill"),
        pd_instance(INSTANCE_ARGS, "decode", "1", name="decode"),
    ),
    scope="module",
    engines=2,
)


@pytest.fixture(scope="module")
def pd(pd_instances):
    cluster = Cluster(*pd_instances)
    with cluster.router:
        yield cluster


def _turn(router, messages, session, *, stream=False, branch=None, **extra):
    """One turn through the router: (text, split, route header, usage). ``session`` None: the
    body names none (``extra`` may carry a cache hint instead)."""
    body = chat_body(
        router, messages, session=session, branch=branch, max_tokens=MAX_TOKENS, **extra
    )
    with client(router) as c:
        if not stream:
            r = c.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            data = r.json()
            assert "kv_transfer_params" not in data
            return text_of(data), data.get("kvbranch"), r.headers["x-kvbranch-route"], data["usage"]
        body.update(stream=True, stream_options={"include_usage": True})
        text, split, usage = "", None, None
        with c.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            route = r.headers["x-kvbranch-route"]
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[len("data: ") :])
                assert "kv_transfer_params" not in chunk
                if chunk.get("choices"):
                    text += chunk["choices"][0]["delta"].get("content") or ""
                split = chunk.get("kvbranch") or split
                usage = chunk.get("usage") or usage
        return text, split, route, usage


def _conversation(seed: int) -> list[dict]:
    return [
        {"role": "system", "content": system_prompt(words=500, seed=seed)},
        {"role": "user", "content": "Which tool should run first? Answer briefly."},
    ]


FOLLOW_UPS = [
    "The tool returned: status ok, 42 records. What next?",
    "The second tool returned: price 17. Summarize.",
    "Any risk left? One line.",
]


def test_turns_match_a_single_instance_and_pull_history_from_decode(pd, plain_server):
    messages = _conversation(seed=301)
    previous = None
    for turn, follow_up in enumerate([None, *FOLLOW_UPS]):
        if follow_up is not None:
            messages.append({"role": "user", "content": follow_up})
        text, split, route, usage = _turn(pd.router, messages, "pd-main", stream=turn % 2 == 1)
        reference = text_of(chat(plain_server, messages, max_tokens=MAX_TOKENS))
        assert text == reference, f"turn {turn}: P/D answer differs from a single instance"
        assert split["prompt_tokens"] == usage["prompt_tokens"]
        if previous is None:
            assert route == "pd"
        else:
            # D held prompt + answer of the last turn; P pulls it and computes only what is new
            assert route == "pd+pull"
            assert split["remote_hit_tokens"] > 0
            new = usage["prompt_tokens"] - previous["prompt_tokens"] - previous["completion_tokens"]
            assert split["recomputed_tokens"] <= new + 1
        previous = usage
        messages.append({"role": "assistant", "content": text})


def test_a_rewritten_history_pulls_only_the_matching_prefix(pd, plain_server):
    messages = _conversation(seed=302)
    text, _, _, usage = _turn(pd.router, messages, "pd-rewrite")
    # the client re-renders the assistant turn differently from what D generated
    messages += [
        {"role": "assistant", "content": "A different answer. " + text[::-1]},
        {"role": "user", "content": FOLLOW_UPS[0]},
    ]
    text2, split, route, usage2 = _turn(pd.router, messages, "pd-rewrite")
    assert route == "pd+pull"
    assert text2 == text_of(chat(plain_server, messages, max_tokens=MAX_TOKENS))
    # the pull stopped where the tokens differ: D held more than P took
    held = usage["prompt_tokens"] + usage["completion_tokens"] - 1
    assert split["device_hit_tokens"] + split["remote_hit_tokens"] < held


def test_forks_and_session_routes_work_through_the_router(pd, plain_server):
    messages = _conversation(seed=303)
    with client(pd.router) as c:
        r = c.post("/v1/kvbranch/sessions", json={"session_id": "pd-routes"})
        assert r.status_code == 201, r.text
        text, _, _, _ = _turn(pd.router, messages, "pd-routes")
        stats = c.get("/v1/kvbranch/stats").json()
        held = [e for e in stats["cluster"]["index"] if e["session_id"] == "pd-routes"]
        assert held and held[0]["decode"] == pd.decode.url and held[0]["tokens"] > 0
        assert {i["role"] for i in stats["cluster"]["instances"]} == {"prefill", "decode"}
        fork = c.post(
            "/v1/kvbranch/sessions/pd-routes/branches", json={"parent": "main", "branch_id": "alt"}
        )
        assert fork.status_code == 201, fork.text
        alt = messages + [
            {"role": "assistant", "content": text},
            {"role": "user", "content": "Try the other plan instead."},
        ]
        alt_text, split, _, _ = _turn(pd.router, alt, "pd-routes", branch="alt")
        assert alt_text == text_of(chat(plain_server, alt, max_tokens=MAX_TOKENS))
        assert split["branch_id"] == "alt"
        assert split["recomputed_tokens"] < split["prompt_tokens"]
        branches = c.get("/v1/kvbranch/sessions/pd-routes/branches").json()
        assert {b["branch_id"] for b in branches} >= {"main", "alt"}
        assert c.delete("/v1/kvbranch/sessions/pd-routes").status_code == 200
        stats = c.get("/v1/kvbranch/stats").json()
        assert not [e for e in stats["cluster"]["index"] if e["session_id"] == "pd-routes"]
        assert c.get("/v1/kvbranch/sessions/pd-routes").status_code == 404


@pytest.mark.parametrize("cache_key", ["pd-agent-42", "pd agent/42 (not an id)"])
def test_a_prompt_cache_key_turn_is_pulled_like_a_session(pd, plain_server, cache_key):
    """No session id, only OpenAI's prompt_cache_key: the router keys the turn by the session
    the instances derive from it (the key, or pck-<digest>), so turn 2 pulls from D."""
    messages = _conversation(seed=304 if " " in cache_key else 305)
    text, _, route, _ = _turn(pd.router, messages, None, prompt_cache_key=cache_key)
    assert route == "pd"
    messages += [
        {"role": "assistant", "content": text},
        {"role": "user", "content": FOLLOW_UPS[0]},
    ]
    text2, split, route, _ = _turn(pd.router, messages, None, prompt_cache_key=cache_key)
    assert route == "pd+pull" and split["remote_hit_tokens"] > 0
    assert text2 == text_of(chat(plain_server, messages, max_tokens=MAX_TOKENS))
    session = split["session_id"]  # the instance's own session for the key
    assert session.startswith("pck-") if " " in cache_key else session == cache_key
    with client(pd.router) as c:
        index = c.get("/v1/kvbranch/stats").json()["cluster"]["index"]
    held = [e for e in index if e["session_id"] == session]  # filed under that very session
    assert held and held[0]["decode"] == pd.decode.url


def test_bad_input_to_the_router_is_a_clear_4xx(pd):
    before = {s.name: pd_activity(s) for s in (pd.prefill, pd.decode)}
    with client(pd.router) as c:
        r = c.post(
            "/v1/chat/completions",
            content=b"{not json",
            headers={"content-type": "application/json"},
        )
        assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
        r = c.post("/v1/chat/completions", json=["a", "list"])
        assert r.status_code == 400 and "object" in r.json()["error"]["message"]
        body = {
            "model": pd.router.model,
            "messages": [{"role": "user", "content": "hi"}],
            "kv_transfer_params": {"do_remote_decode": True},
        }
        r = c.post("/v1/chat/completions", json=body)
        assert r.status_code == 400 and "kv_transfer_params" in r.json()["error"]["message"]
        r = c.post("/v1/chat/completions", json={"model": pd.router.model, "messages": "hi"})
        assert 400 <= r.status_code < 500 and r.json()["error"]["message"]
        r = c.post(
            "/v1/chat/completions",
            json={"model": pd.router.model, "messages": [], "max_tokens": -3},
        )
        assert 400 <= r.status_code < 500
        r = c.post("/v1/kvbranch/sessions", json={"pin_ttl_s": -1})
        assert r.status_code in (400, 422)
        assert c.get("/v1/kvbranch/sessions/no-such-session").status_code == 404
        # the cluster still serves after all that
        assert c.get("/health").status_code == 200
    # and none of it reached an engine: no generation, no pull, no hold, no claim
    assert {s.name: pd_activity(s) for s in (pd.prefill, pd.decode)} == before


def test_the_sdk_runs_a_session_through_the_router(pd, plain_server):
    with KVBranchClient(pd.router.url, model=pd.router.model, timeout=600) as kvb:
        assert kvb.kvbranch_available()
        session = kvb.session(system=system_prompt(words=300, seed=305))
        first = session.main.chat(
            "Which tool should run first?", max_tokens=MAX_TOKENS, temperature=0
        )
        assert first.split is not None and first.split.session_id == session.session_id
        stream = session.main.chat_stream(
            "The tool said: ok, 3 rows. Next?", max_tokens=MAX_TOKENS, temperature=0
        )
        list(stream)
        second = stream.result
        assert second.split is not None and second.split.remote_hit_tokens > 0
        assert second.text == text_of(
            chat(plain_server, session.main.messages[:-1], max_tokens=MAX_TOKENS)
        )
        session.delete()


def test_an_instance_killed_between_turns_costs_a_recompute_not_an_answer(pd, plain_server):
    messages = _conversation(seed=304)
    text, _, _, _ = _turn(pd.router, messages, "pd-kill")
    messages += [{"role": "assistant", "content": text}, {"role": "user", "content": FOLLOW_UPS[0]}]
    pd.decode.stop()
    text2, split, route, _ = _turn(pd.router, messages, "pd-kill", stream=True)
    assert route == "prefill-only"
    assert text2 == text_of(chat(plain_server, messages, max_tokens=MAX_TOKENS))
    assert split["remote_hit_tokens"] == 0
    with client(pd.router) as c:
        health = c.get("/health")  # degraded, yet still serving through the prefill instance
        assert health.status_code == 200 and health.json()["status"] == "degraded"

    pd.decode.start()  # a fresh decode instance (new instance id) on the same port
    with client(pd.router) as c:
        # The router learns it within a probe interval; its /health probes every instance now,
        # so the next turn does not race the background probe that would mark it up.
        health = c.get("/health")
        assert health.status_code == 200 and health.json()["status"] == "ok"
    messages += [
        {"role": "assistant", "content": text2},
        {"role": "user", "content": FOLLOW_UPS[1]},
    ]
    text3, _, route, _ = _turn(pd.router, messages, "pd-kill")
    assert route == "pd"  # nothing held on the new D yet
    assert text3 == text_of(chat(plain_server, messages, max_tokens=MAX_TOKENS))

    pd.prefill.stop()
    messages += [
        {"role": "assistant", "content": text3},
        {"role": "user", "content": FOLLOW_UPS[2]},
    ]
    text4, _, route, _ = _turn(pd.router, messages, "pd-kill")
    assert route == "decode-only"
    assert text4 == text_of(chat(plain_server, messages, max_tokens=MAX_TOKENS))
    with client(pd.router) as c:
        r = c.get("/v1/kvbranch/stats")
        assert r.status_code == 503 and "prefill" in r.json()["error"]["message"]
    with httpx.Client(timeout=10) as c:
        assert c.get(pd.router.url + "/metrics").status_code == 200
