"""The connector against the real engine and model: correctness first, then effect, pins,
forks, prefetch and bad input. ``kvbranch_server`` has a 45-block host store and a 9-block pin
budget (see conftest)."""

from __future__ import annotations

import time

import pytest

from tests.integration.helpers import (
    BLOCK,
    branch_info,
    chat,
    client,
    create_session,
    filler,
    reset_device_cache,
    system_prompt,
    text_of,
    two_messages,
)

OBSERVATIONS = [
    "Tool result: weather in Paris is 18C, light rain, wind 12 km/h, humidity 80 percent.",
    "Tool result: the flight AF1234 departs 09:40 from gate K32, boarding 09:10, on time.",
    "Tool result: hotel Le Marais has 3 rooms left at 142 EUR per night, breakfast included.",
]


def _conversation_turns(server, session, *, branch=None, reset_between=False, base=None):
    """Three agent turns; returns (texts, responses, message history)."""
    messages = list(base or [{"role": "system", "content": system_prompt()}])
    texts, responses = [], []
    for turn, observation in enumerate(OBSERVATIONS):
        messages.append({"role": "user", "content": f"Step {turn}. {observation} What next?"})
        response = chat(server, messages, session=session, branch=branch, max_tokens=16)
        texts.append(text_of(response))
        responses.append(response)
        messages.append({"role": "assistant", "content": texts[-1]})
        if reset_between:
            reset_device_cache(server)
    return texts, responses, messages


def test_greedy_outputs_identical_to_plain_vllm_with_forks_and_store_only(
    kvbranch_server, plain_server
):
    """Token-for-token equality with plain vLLM, also when the device prefix cache was dropped
    before every turn so that every reused token came from the host store."""
    reset_device_cache(kvbranch_server)
    texts, responses, history = _conversation_turns(
        kvbranch_server, "eq-session", reset_between=True
    )
    plain_texts, _, _ = _conversation_turns(plain_server, None)
    assert texts == plain_texts
    # turns 2 and 3 reused history through the host store only
    for response in responses[1:]:
        split = response["kvbranch"]
        assert split["device_hit_tokens"] == 0
        assert split["host_hit_tokens"] >= BLOCK
        assert (
            response["usage"]["prompt_tokens_details"]["cached_tokens"] == split["host_hit_tokens"]
        )

    # fork at the second user message, continue differently on both servers
    fork_point = history[:4]  # system, user0, assistant0, user1
    with client(kvbranch_server) as c:
        r = c.post(
            "/v1/kvbranch/sessions/eq-session/branches",
            json={"parent": "main", "branch_id": "alt", "messages": fork_point[:3]},
        )
        assert r.status_code == 201, r.text
        assert r.json()["fork_offset_tokens"] > 0
    alt = fork_point[:3] + [{"role": "user", "content": "Instead, book a train. Which one?"}]
    reset_device_cache(kvbranch_server)
    forked = chat(kvbranch_server, alt, session="eq-session", branch="alt", max_tokens=16)
    plain_forked = chat(plain_server, alt, max_tokens=16)
    assert text_of(forked) == text_of(plain_forked)
    assert forked["kvbranch"]["host_hit_tokens"] >= BLOCK
    assert forked["kvbranch"]["branch_id"] == "alt"


def test_next_turn_recomputes_only_new_tokens_after_device_loss(kvbranch_server):
    messages = [
        {"role": "system", "content": system_prompt(seed=7)},
        {"role": "user", "content": "Step 0. " + OBSERVATIONS[0]},
    ]
    first = chat(kvbranch_server, messages, session="effect", max_tokens=16)
    known = first["usage"]["prompt_tokens"] + first["usage"]["completion_tokens"]
    messages.append({"role": "assistant", "content": text_of(first)})
    messages.append({"role": "user", "content": "Step 1. " + OBSERVATIONS[1]})
    reset_device_cache(kvbranch_server)
    second = chat(kvbranch_server, messages, session="effect", max_tokens=16)
    split = second["kvbranch"]
    new_tokens = second["usage"]["prompt_tokens"] - known
    assert split["device_hit_tokens"] == 0
    assert split["host_hit_tokens"] > 0
    # at most the new tokens plus the partial last block of the history
    assert split["recomputed_tokens"] <= new_tokens + BLOCK


def test_pinned_branch_survives_pressure_that_evicts_unpinned(kvbranch_server):
    create_session(kvbranch_server, session_id="pinned-s", pin_ttl_s=600)
    create_session(kvbranch_server, session_id="loose-s", auto_pin=False)
    for session, seed in (("pinned-s", 11), ("loose-s", 12)):
        chat(
            kvbranch_server,
            [
                {"role": "system", "content": system_prompt(words=300, seed=seed)},
                {"role": "user", "content": "Hello"},
            ],
            session=session,
            max_tokens=4,
        )
    pinned, loose = (branch_info(kvbranch_server, s) for s in ("pinned-s", "loose-s"))
    assert pinned["pinned"] and pinned["pinned_blocks"] >= 2
    assert not loose["pinned"] and loose["stored_blocks"] >= 2
    with client(kvbranch_server) as c:
        evictions_before = c.get("/v1/kvbranch/stats").json()["store"]["evictions"]
    # pressure: more unrelated blocks than the whole host store (45 blocks)
    for i in range(8):
        chat(kvbranch_server, filler(i), max_tokens=1)
    pinned, loose = (branch_info(kvbranch_server, s) for s in ("pinned-s", "loose-s"))
    with client(kvbranch_server) as c:
        stats = c.get("/v1/kvbranch/stats").json()
    assert stats["store"]["evictions"] > evictions_before  # this pressure evicted
    assert pinned["stored_blocks"] == pinned["pinned_blocks"]  # all of it survived
    assert loose["stored_blocks"] == 0  # evicted


def test_pin_ttl_expiry_releases_the_pin(kvbranch_server):
    """The pin lasts its TTL and then goes: waited for on the branch's state, and never gone
    before the TTL counted from before the request that pinned it."""
    ttl_s = 2.0
    create_session(kvbranch_server, session_id="ttl-s", pin_ttl_s=ttl_s)
    started = time.monotonic()
    chat(
        kvbranch_server,
        two_messages("Hi", words=250, seed=21),
        session="ttl-s",
        max_tokens=2,
    )
    branch = branch_info(kvbranch_server, "ttl-s")
    assert branch["pinned"] and branch["pinned_blocks"] > 0
    deadline = started + ttl_s + 30
    while branch["pinned"] and time.monotonic() < deadline:
        time.sleep(0.1)
        branch = branch_info(kvbranch_server, "ttl-s")
    assert not branch["pinned"] and branch["pinned_blocks"] == 0
    assert time.monotonic() - started >= ttl_s  # not released early


def test_pin_budget_is_enforced(kvbranch_server):
    """A branch larger than the whole pin budget (9 blocks): an explicit pin is refused with
    409; its automatic pin degrades and the chat request itself succeeds."""
    long_prompt = two_messages("Hi", words=500, seed=31)
    with client(kvbranch_server) as c:
        refused_before = c.get("/v1/kvbranch/stats").json()["pins_refused"]
    response = chat(kvbranch_server, long_prompt, session="big-s", max_tokens=2)
    assert response["usage"]["prompt_tokens"] > 10 * BLOCK
    branch = branch_info(kvbranch_server, "big-s")
    assert branch["degraded"] and branch["pinned_blocks"] == 0
    with client(kvbranch_server) as c:
        r = c.post("/v1/kvbranch/sessions/big-s/branches/main/pin", json={"ttl_s": 60})
        assert r.status_code == 409
        assert "pin budget" in r.json()["error"]["message"]
        stats = c.get("/v1/kvbranch/stats").json()
    assert stats["pins_refused"] == refused_before + 1  # the explicit pin above
    assert stats["store"]["pinned_bytes"] <= stats["store"]["pin_budget_bytes"]


def test_fork_shares_parent_blocks(kvbranch_server):
    base = two_messages("Plan a trip.", words=250, seed=41)
    first = chat(kvbranch_server, base, session="fork-s", max_tokens=8)
    parent = branch_info(kvbranch_server, "fork-s")
    with client(kvbranch_server) as c:
        session_before = c.get("/v1/kvbranch/sessions/fork-s").json()
        r = c.post(
            "/v1/kvbranch/sessions/fork-s/branches", json={"parent": "main", "branch_id": "plan-b"}
        )
        assert r.status_code == 201
        fork = r.json()
        session_after = c.get("/v1/kvbranch/sessions/fork-s").json()
    assert fork["parent"] == "main" and fork["num_tokens"] == parent["num_tokens"]
    assert fork["pinned_blocks"] == parent["pinned_blocks"] > 0
    # shared by reference: the session's distinct pinned bytes did not grow
    assert session_after["pinned_bytes"] == session_before["pinned_bytes"]
    with client(kvbranch_server) as c:
        used_before = c.get("/v1/kvbranch/stats").json()["store"]["used_blocks"]
    alt = base + [
        {"role": "assistant", "content": text_of(first)},
        {"role": "user", "content": "Make it cheaper."},
    ]
    response = chat(kvbranch_server, alt, session="fork-s", branch="plan-b", max_tokens=8)
    with client(kvbranch_server) as c:
        used_after = c.get("/v1/kvbranch/stats").json()["store"]["used_blocks"]
        # deleting the fork releases only what the parent does not hold
        deleted = c.delete("/v1/kvbranch/sessions/fork-s/branches/plan-b").json()
    own_tokens = response["usage"]["prompt_tokens"] - parent["num_tokens"] + 8
    # its own full blocks, plus its tail: the partial last block kept for token-exact reuse
    assert used_after - used_before <= own_tokens // BLOCK + 2
    assert deleted["released_blocks"] <= own_tokens // BLOCK + 2
    assert branch_info(kvbranch_server, "fork-s")["pinned_blocks"] == parent["pinned_blocks"]


def _wait_for_prefetch(c, before: int) -> None:
    deadline = time.monotonic() + 120
    while c.get("/v1/kvbranch/stats").json()["prefetches"] == before:
        assert time.monotonic() < deadline, "prefetch never ran"
        time.sleep(0.2)


def test_prefetch_to_device_warms_the_device_cache(kvbranch_server):
    messages = two_messages("Look up the weather.", words=300, seed=51)
    first = chat(kvbranch_server, messages, session="pf-s", max_tokens=8)
    reset_device_cache(kvbranch_server)
    with client(kvbranch_server) as c:
        before = c.get("/v1/kvbranch/stats").json()["prefetches"]
        r = c.post("/v1/kvbranch/sessions/pf-s/branches/main/prefetch", json={"to_device": True})
        assert r.status_code == 202 and r.json()["status"] == "scheduled"
        _wait_for_prefetch(c, before)
    messages += [
        {"role": "assistant", "content": text_of(first)},
        {"role": "user", "content": OBSERVATIONS[0]},
    ]
    second = chat(kvbranch_server, messages, session="pf-s", max_tokens=8)
    assert second["kvbranch"]["device_hit_tokens"] >= BLOCK
    # every full block came from the device; only the stored tail (the partial last block,
    # which the device prefix cache never keeps) from the host store
    assert second["kvbranch"]["host_hit_tokens"] < BLOCK


def test_prefetch_of_a_branch_in_the_host_store_costs_no_engine_step(kvbranch_server, plain_server):
    """The device cache lost the branch, the host store holds it: the prefetch runs nothing,
    and the next turn loads the whole history from the host store, the same answer as plain
    vLLM's."""
    messages = two_messages("Look up the trains.", words=300, seed=52)
    first = chat(kvbranch_server, messages, session="pf-host", max_tokens=8)
    reset_device_cache(kvbranch_server)
    with client(kvbranch_server) as c:
        before = c.get("/v1/kvbranch/stats").json()
        r = c.post("/v1/kvbranch/sessions/pf-host/branches/main/prefetch")
        assert r.status_code == 202 and r.json()["status"] == "in_host_store", r.text
        after = c.get("/v1/kvbranch/stats").json()
    assert after["prefetches"] == before["prefetches"]
    assert after["prefetches_skipped"] == before["prefetches_skipped"] + 1
    messages += [
        {"role": "assistant", "content": text_of(first)},
        {"role": "user", "content": OBSERVATIONS[1]},
    ]
    second = chat(kvbranch_server, messages, session="pf-host", max_tokens=8)
    split = second["kvbranch"]
    assert split["device_hit_tokens"] == 0
    assert split["host_hit_tokens"] >= first["usage"]["prompt_tokens"] - 1
    assert text_of(second) == text_of(chat(plain_server, messages, max_tokens=8))


def test_deleting_a_session_drops_its_pins(kvbranch_server):
    chat(
        kvbranch_server,
        two_messages("Hi", words=200, seed=61),
        session="del-s",
        max_tokens=2,
    )
    assert branch_info(kvbranch_server, "del-s")["pinned_blocks"] > 0
    with client(kvbranch_server) as c:
        r = c.delete("/v1/kvbranch/sessions/del-s")
        assert r.status_code == 200 and r.json()["released_blocks"] > 0
        assert c.get("/v1/kvbranch/sessions/del-s").status_code == 404


# Validation errors come back as 400 through vLLM's own exception handler, with the field in
# the message and in ``error.param``.
BAD_REQUESTS = [
    ("post", "/v1/kvbranch/sessions", {"session_id": "bad id!"}, 400, "session_id"),
    ("post", "/v1/kvbranch/sessions", {"pin_ttl_s": -1}, 400, "pin_ttl_s"),
    ("post", "/v1/kvbranch/sessions", {"pin_ttl_s": 1e12}, 400, "pin_ttl_s"),
    ("post", "/v1/kvbranch/sessions", {"unknown": 1}, 400, "unknown"),
    ("post", "/v1/kvbranch/sessions", [1, 2], 400, "object"),
    ("get", "/v1/kvbranch/sessions/no-such-session", None, 404, "not found"),
    ("delete", "/v1/kvbranch/sessions/no-such-session", None, 404, "not found"),
    ("get", "/v1/kvbranch/sessions/" + "x" * 200, None, 400, "session_id"),
    ("get", "/v1/kvbranch/sessions/bad-s/branches/nope", None, 404, "nope"),
    ("post", "/v1/kvbranch/sessions/bad-s/branches", {"parent": "nope"}, 404, "nope"),
    ("post", "/v1/kvbranch/sessions/bad-s/branches", {"token_offset": -3}, 400, "token_offset"),
    ("post", "/v1/kvbranch/sessions/bad-s/branches", {"token_offset": 10**9}, 400, "past the end"),
    (
        "post",
        "/v1/kvbranch/sessions/bad-s/branches",
        {"token_offset": 1, "messages": [{"role": "user", "content": "x"}]},
        400,
        "either",
    ),
    ("post", "/v1/kvbranch/sessions/bad-s/branches", {"branch_id": "main"}, 409, "exists"),
    ("post", "/v1/kvbranch/sessions/bad-s/branches/main/pin", {}, 400, "ttl_s"),
    ("post", "/v1/kvbranch/sessions/bad-s/branches/main/pin", {"ttl_s": "soon"}, 400, "ttl_s"),
    ("post", "/v1/kvbranch/sessions/bad-s/branches/main/pin", {"ttl_s": 0}, 400, "ttl_s"),
    ("post", "/v1/kvbranch/sessions/bad-s/branches/ghost/pin", {"ttl_s": 5}, 404, "ghost"),
    ("delete", "/v1/kvbranch/sessions/bad-s/branches/ghost/pin", None, 404, "ghost"),
    ("post", "/v1/kvbranch/sessions/bad-s/branches/ghost/prefetch", None, 404, "ghost"),
    (
        "post",
        "/v1/kvbranch/sessions/bad-s/branches/main/prefetch",
        {"to_device": "maybe"},
        400,
        "to_device",
    ),
    (
        "post",
        "/v1/kvbranch/sessions/bad-s/branches/main/prefetch",
        {"todevice": True},
        400,
        "todevice",
    ),
    ("post", "/v1/kvbranch/sessions/bad-s", None, 405, "Method Not Allowed"),
]


@pytest.mark.parametrize(
    "method,path,body,status,needle",
    BAD_REQUESTS,
    ids=[f"{m} {p[:48]} {s}" for m, p, _, s, _ in BAD_REQUESTS],
)
def test_bad_input_gets_a_clear_4xx(kvbranch_server, method, path, body, status, needle):
    with client(kvbranch_server) as c:
        if c.get("/v1/kvbranch/sessions/bad-s").status_code == 404:
            assert c.post("/v1/kvbranch/sessions", json={"session_id": "bad-s"}).status_code == 201
        kwargs = {"json": body} if body is not None else {}
        r = c.request(method.upper(), path, **kwargs)
        assert r.status_code == status, r.text
        assert needle and needle in r.text, r.text
        # nothing crashed
        assert c.get("/v1/kvbranch/health").json()["status"] == "ok"


def test_duplicate_session_is_a_conflict(kvbranch_server):
    with client(kvbranch_server) as c:
        assert c.post("/v1/kvbranch/sessions", json={"session_id": "dup-s"}).status_code == 201
        r = c.post("/v1/kvbranch/sessions", json={"session_id": "dup-s"})
    assert r.status_code == 409 and "already exists" in r.json()["error"]["message"]


def test_server_made_ids_are_unguessable(kvbranch_server):
    with client(kvbranch_server) as c:
        ids = {c.post("/v1/kvbranch/sessions", json={}).json()["session_id"] for _ in range(3)}
    assert len(ids) == 3 and all(len(i) >= 20 for i in ids)
