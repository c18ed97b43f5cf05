"""Never wrong KV across instances: real P, D and router (NIXL over UCX on loopback), a small
device cache (0.1 GiB, 18 blocks of 128 tokens) and long holds (900 s), compared with a plain
vLLM server on every answer (greedy, token for token).

* a history that diverges from what D holds (an edited assistant turn, a regeneration) with P's
  device cache *and* host store emptied first, so that the pull is the only source of the
  prefix: P must read exactly the verified prefix (the old code read D's *last* blocks into
  P's first positions: "A: A: A: ...");
* bad transfer handles sent straight to P and to D (forged, out of range, unclaimed, reused,
  expired, another tenant's salt): a 200 with the plain server's answer or a 4xx, never a 5xx;
* holds yield to new work: concurrent sessions whose held conversations fill D's cache still
  get answered (the old code left them "waiting" for the whole 900 s hold);
* turns D serves alone (the router's fallback while P is unreachable) hold their blocks like
  any other turn: P's read ends the hold, new work can take it (the old code lost track of
  them, so their blocks stayed taken for good: a CI run hung on it).
"""

from __future__ import annotations

import concurrent.futures
import json
import time

import httpx
import pytest

from sdk.contract import CLAIM_FIELD, HOLD_CLAIM_PATH
from server.connector.pd import transfer_auth
from server.connector.pd.transfer_auth import (
    EXPIRES_FIELD,
    MAC_FIELD,
    claim_valid,
    make_claim,
    seal,
)
from tests.integration.helpers import chat, client, empty_caches, stats, system_prompt, text_of
from tests.integration.trust_cluster import CLUSTER_SECRET, as_router

SECRET = CLUSTER_SECRET
SYSTEM = system_prompt(words=120, seed=13)
#: How long P's caches may take to empty (:func:`empty_caches`): a prefill leg nobody decoded
#: holds its blocks up to 30 s.
P_RESET_WAIT_S = 60


@pytest.fixture(scope="module")
def pd(keyed_pd):
    return keyed_pd


def _body(server, messages, max_tokens, **extra):
    return {
        "model": server.model,
        "messages": messages,
        "temperature": 0,
        "max_tokens": max_tokens,
        **extra,
    }


def _post(server, body, headers=None) -> httpx.Response:
    """As the router sends it (signed): these tests check the instances' own handle checks."""
    with client(server, as_router()) as c:
        return c.post("/v1/chat/completions", json=body, headers=headers or {})


def _pd_stats(server) -> dict:
    return stats(server).get("pd") or {}


def _ask_long(session: str) -> tuple[list[dict], str]:
    return (
        [
            {"role": "system", "content": SYSTEM},
            {
                "role": "user",
                "content": f"Session {session}: write a long story about a "
                "robot that learns to cook, in many sentences.",
            },
        ],
        session,
    )


def _held_turn(decode, plain_server, tag: str) -> tuple[list[dict], str, dict, list[dict], str]:
    """A long first turn that D holds, and the next turn: (messages, session, D's handle,
    the next turn's messages, plain vLLM's answer to them)."""
    messages, session = _ask_long(tag)
    handle = _held_handle(decode, messages, session)
    reply = text_of(chat(plain_server, messages, max_tokens=40))
    turn2 = _next_turn(messages, reply)
    expected = text_of(chat(plain_server, turn2, max_tokens=16))
    return messages, session, handle, turn2, expected


# --- turns D serves alone (the router's fallback while P is unreachable) ---------------------
# First in the module: D holds nothing yet, so its hold count is exact.
def _holds_at_most(decode, n: int, timeout_s: float = 60.0) -> int:
    """D's hold count once it is at most ``n`` (or when ``timeout_s`` ran out)."""
    deadline = time.monotonic() + timeout_s
    while True:
        holds = _pd_stats(decode)["holds"]
        if holds <= n or time.monotonic() > deadline:
            return holds
        time.sleep(0.5)


def test_a_turn_d_served_alone_ends_its_hold_when_p_reads_it(pd, plain_server):
    """D serves a whole turn (``do_remote_prefill: false``, as the router sends it while P is
    unreachable) and holds its blocks; P's read of them ends the hold like any other. The old
    code never announced such a hold to D's worker: P's read was "unrecognized", the blocks
    stayed taken for good, and D's cache filled turn by turn until new turns waited forever
    (CI: three turns stuck for the router's whole 600 s timeout)."""
    prefill, decode, router = pd
    before = _pd_stats(decode)
    messages, session = _ask_long("alone")
    handle = _held_handle(decode, messages, session)
    assert _pd_stats(decode)["holds"] == before["holds"] + 1
    claim = _claim(decode, handle)
    assert claim.status_code == 200, claim.text
    reply = text_of(chat(plain_server, messages, max_tokens=40))
    turn2 = _next_turn(messages, reply)
    empty_caches(prefill, P_RESET_WAIT_S)
    r, answer = _at_p(prefill, decode, turn2, dict(handle, **claim.json()))
    assert answer == text_of(chat(plain_server, turn2, max_tokens=16))
    assert r.json()["kvbranch"]["remote_hit_tokens"] > 0
    assert _holds_at_most(decode, before["holds"]) == before["holds"]
    assert _pd_stats(decode)["holds_released_for_new_work"] == before["holds_released_for_new_work"]


def test_turns_d_served_alone_yield_their_blocks_to_new_work(pd, plain_server):
    """Three such holds take 15 of D's 17 usable blocks; a fourth turn needs 5: D releases the
    oldest holds and answers at once instead of waiting out the 900 s hold."""
    prefill, decode, router = pd
    released = _pd_stats(decode)["holds_released_for_new_work"]
    conversations = [
        [
            {"role": "system", "content": system_prompt(words=190, seed=200 + i)},
            {"role": "user", "content": f"Agent {i}: summarise the notes."},
        ]
        for i in range(4)
    ]
    for i, messages in enumerate(conversations[:3]):
        _held_handle(decode, messages, f"alone-full{i}", max_tokens=8)
    body = _body(
        decode,
        conversations[3],
        8,
        session_id="alone-full3",
        kv_transfer_params={"do_remote_prefill": False},
    )
    with httpx.Client(
        base_url=decode.url, timeout=240.0, headers=decode.headers(), auth=as_router()
    ) as c:
        r = c.post("/v1/chat/completions", json=body)  # the old code: no answer in 900 s
    assert r.status_code == 200, r.text
    assert text_of(r.json()) == text_of(chat(plain_server, conversations[3], max_tokens=8))
    assert _pd_stats(decode)["holds_released_for_new_work"] > released


def test_an_edited_assistant_turn_pulls_only_the_verified_prefix(pd, plain_server):
    prefill, decode, router = pd
    messages, session = _ask_long("edit")
    first = chat(router, messages, max_tokens=300, ignore_eos=True, session_id=session)
    assert text_of(first) == text_of(chat(plain_server, messages, max_tokens=300, ignore_eos=True))
    reply = text_of(first)
    cut = len(reply) // 2  # D holds ~300 generated tokens; diverge ~150 tokens in
    edited = reply[:cut] + " Then everything changed, and nobody knew why."
    turn2 = [
        *messages,
        {"role": "assistant", "content": edited},
        {"role": "user", "content": "Summarize the story in one sentence."},
    ]
    empty_caches(prefill, P_RESET_WAIT_S)
    second = chat(router, turn2, max_tokens=48, session_id=session)
    split = second["kvbranch"]
    assert split["device_hit_tokens"] == 0 and split["host_hit_tokens"] == 0, split
    # pulled: the common prefix, several blocks, but not D's tokens after the edit
    assert 3 * 128 <= split["remote_hit_tokens"] < first["usage"]["prompt_tokens"] + 300, split
    assert text_of(second) == text_of(chat(plain_server, turn2, max_tokens=48))
    # P cached what it pulled under its own hashes: a third turn on top must be right too
    turn3 = [
        *turn2,
        {"role": "assistant", "content": text_of(second)},
        {"role": "user", "content": "And in three words?"},
    ]
    assert text_of(chat(prefill, turn3, max_tokens=24)) == text_of(
        chat(plain_server, turn3, max_tokens=24)
    )


def test_a_regeneration_pulls_a_prefix_of_what_d_holds(pd, plain_server):
    prefill, decode, router = pd
    messages, session = _ask_long("regen")
    turn1 = chat(router, messages, max_tokens=200, ignore_eos=True, session_id=session)
    turn2 = [
        *messages,
        {"role": "assistant", "content": text_of(turn1)},
        {"role": "user", "content": "Give the robot a name and explain it."},
    ]
    chat(router, turn2, max_tokens=160, ignore_eos=True, session_id=session)
    # regenerate turn 2's answer: same branch, a shorter history than D now holds
    empty_caches(prefill, P_RESET_WAIT_S)
    again = chat(router, turn2, max_tokens=48, session_id=session)
    split = again["kvbranch"]
    assert split["device_hit_tokens"] == 0 and split["remote_hit_tokens"] >= 3 * 128, split
    assert split["remote_hit_tokens"] == split["prompt_tokens"] - 1 - split["host_hit_tokens"]
    assert text_of(again) == text_of(chat(plain_server, turn2, max_tokens=48))


# --- bad handles -------------------------------------------------------------------------------
def _held_handle(decode, messages, session, max_tokens=40) -> dict:
    """A real handle: a turn served by D alone holds its blocks and returns the params."""
    data = chat(
        decode,
        messages,
        max_tokens=max_tokens,
        session_id=session,
        kv_transfer_params={"do_remote_prefill": False},
        auth=as_router(),
    )
    params = data.get("kv_transfer_params")
    assert isinstance(params, dict) and params.get("remote_block_ids"), data
    return params


def _claim(decode, handle) -> httpx.Response:
    with client(decode, as_router()) as c:
        return c.post(HOLD_CLAIM_PATH, json={"handle": handle})


def _next_turn(messages, reply):
    return [
        *messages,
        {"role": "assistant", "content": reply},
        {"role": "user", "content": "Now list three ingredients."},
    ]


def _at_p(prefill, decode, messages, params, **extra) -> tuple[httpx.Response, str | None]:
    """One P/D turn by hand, straight at the instances as the router runs it: P prefills
    (``max_tokens=1``) with the transfer handle ``params``, then D decodes with P's handle.
    Returns P's response (its split says what was pulled) and D's answer (None when P refused
    the request with a 4xx)."""
    r = _post(
        prefill,
        _body(
            prefill,
            messages,
            1,
            **extra,
            kv_transfer_params=dict(params, do_remote_decode=True, do_remote_prefill=False),
        ),
    )
    assert r.status_code < 500, r.text
    if r.status_code >= 400:
        assert "message" in r.json()["error"], r.text
        return r, None
    p_handle = r.json().get("kv_transfer_params")
    assert isinstance(p_handle, dict) and p_handle.get("remote_block_ids"), r.text
    d = _post(decode, _body(decode, messages, 16, **extra, kv_transfer_params=p_handle))
    assert d.status_code == 200, d.text
    return r, text_of(d.json())


def _declined(server) -> dict[str, int]:
    """The server's declined transfer handles, by reason."""
    return dict(_pd_stats(server).get("handles_declined") or {})


def _declined_since(server, before: dict[str, int]) -> dict[str, int]:
    """The handles declined since ``before``, by reason (reasons that did not move left out)."""
    now = _declined(server)
    moved = {reason: count - before.get(reason, 0) for reason, count in now.items()}
    return {reason: n for reason, n in moved.items() if n}


def test_handles_are_checked_before_any_read(pd, plain_server):
    prefill, decode, router = pd
    messages, session, handle, turn2, expected = _held_turn(decode, plain_server, "neg")

    def at_p(params):
        empty_caches(prefill, P_RESET_WAIT_S)
        r, answer = _at_p(prefill, decode, turn2, params)
        if answer is None:
            return 0  # refused with a 4xx and a message
        assert answer == expected
        return r.json()["kvbranch"]["remote_hit_tokens"]

    # unclaimed (D may release it any time) -> recompute
    before = _declined(prefill)
    assert at_p(handle) == 0
    assert _declined_since(prefill, before) == {"unclaimed": 1}
    # Forged from the handle once CLAIMED: the claim is valid for the edited ones, so only the
    # seal stands between them and a read of D's memory (forged from an unclaimed handle,
    # each was refused as unclaimed whatever the seal covers). Edited block ids, host, tokens;
    # invented from scratch; out of range; wrong types. Each is refused for its seal: a
    # weaker seal shows as another reason (or none) even if the claim ran out meanwhile.
    r = _claim(decode, handle)
    assert r.status_code == 200, r.text
    claimed = dict(handle, **r.json())
    nixl_port = handle["remote_port"]
    forged = [
        dict(claimed, remote_block_ids=[[b + 1 for b in handle["remote_block_ids"][0]]]),
        dict(claimed, remote_host="10.255.255.1"),
        dict(claimed, remote_num_tokens=10**9),
        {
            "remote_block_ids": [[0, 1, 2]],
            "remote_engine_id": "x",
            "remote_host": "127.0.0.1",
            "remote_port": nixl_port,
            "remote_request_id": "r",
            "remote_num_tokens": 300,
            CLAIM_FIELD: claimed[CLAIM_FIELD],
        },
        {
            "remote_block_ids": [[10**9, -1]],
            "remote_engine_id": handle["remote_engine_id"],
            "remote_host": "127.0.0.1",
            "remote_port": nixl_port,
            "remote_request_id": "r2",
            "remote_num_tokens": -5,
            MAC_FIELD: "00" * 32,
            CLAIM_FIELD: claimed[CLAIM_FIELD],
        },
        dict(claimed, remote_block_ids="1,2,3", **{MAC_FIELD: 7}),
    ]
    before = _declined(prefill)
    for params in forged:
        assert at_p(params) == 0
    assert _declined_since(prefill, before) == {"unsealed": len(forged)}
    # The real one, on a hold of its own claimed right before its turn (the forgeries' turns
    # may outlast the first claim): pulled, same answer.
    fresh = _held_handle(decode, messages, session)
    r = _claim(decode, fresh)
    assert r.status_code == 200, r.text
    claimed = dict(fresh, **r.json())
    before = _declined(prefill)
    assert at_p(claimed) > 0
    # reused: declined (D freed those blocks after the first read)
    assert at_p(claimed) == 0
    assert _declined_since(prefill, before) == {"reused": 1}
    # a second claim of the same hold: 410 with a message
    again = _claim(decode, fresh)
    assert again.status_code == 410 and "message" in again.json()["error"]
    # claim route: bad bodies are 4xx
    with client(decode, as_router()) as c:
        for body in ({}, {"handle": "x"}, {"handle": {"remote_request_id": "r"}}, [1]):
            bad = c.post(HOLD_CLAIM_PATH, json=body)
            assert 400 <= bad.status_code < 500, bad.text


def test_expired_and_foreign_salt_handles_recompute(pd, plain_server):
    """Sealed with the cluster's own secret (as a buggy or slow peer would send them), and
    claimed: each is declined for its own reason, not for a missing claim."""
    prefill, decode, router = pd
    messages, session, handle, turn2, expected = _held_turn(decode, plain_server, "exp")
    # P emptied first (it may wait for an earlier leg's blocks), then the claim: its
    # deadline must outlast both turns below
    empty_caches(prefill, P_RESET_WAIT_S)
    r = _claim(decode, handle)
    assert r.status_code == 200, r.text
    claimed = dict(handle, **r.json())
    # Re-sealed past its expiry: a new seal is a new MAC, which D's claim does not name, so
    # the claim is re-made for it (as D would) and only the expiry is left to decline it.
    stale = seal(dict(claimed, **{EXPIRES_FIELD: time.time() - 1}), SECRET.encode())
    stale[CLAIM_FIELD] = make_claim(stale, claimed[CLAIM_FIELD]["until"], SECRET.encode())
    assert claim_valid(stale, SECRET.encode(), 0.0)
    before = _declined(prefill)
    r, answer = _at_p(prefill, decode, turn2, stale)
    assert answer in (None, expected)
    assert answer is None or r.json()["kvbranch"]["remote_hit_tokens"] == 0
    assert _declined_since(prefill, before) == {"expired": 1}
    # the same (fresh, claimed) blocks requested under another tenant's cache salt
    before = _declined(prefill)
    empty_caches(prefill, P_RESET_WAIT_S)
    r, answer = _at_p(prefill, decode, turn2, claimed, cache_salt="someone-else")
    assert answer in (None, expected)
    assert answer is None or r.json()["kvbranch"]["remote_hit_tokens"] == 0
    assert _declined_since(prefill, before) == {"identity": 1}


def _claim_past_its_read_deadline(claimed: dict) -> dict:
    """D's claim on ``claimed`` as D signs it, still valid on the wall clock (P's own check, made
    when the scheduler offers the pull) but with the read deadline on D's ``perf_counter`` (what
    P's NIXL worker checks right before it reads) already past: the hold ended between P's
    check and P's read."""
    claim = claimed[CLAIM_FIELD]
    body = {
        "handle": claim["handle"],
        "until": claim["until"],
        "until_perf": time.perf_counter() - 1.0,
    }
    return dict(
        body, mac=transfer_auth._mac(SECRET.encode(), json.dumps(body, sort_keys=True).encode())
    )


def _reads_declined_as_expired(server) -> float:
    """NIXL's own count of reads its worker declined because D's deadline had passed."""
    with client(server) as c:
        r = c.get("/metrics")
    assert r.status_code == 200, r.text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in r.text.splitlines()
        if line.startswith("vllm:nixl_num_kv_expired_reqs_total")
    )


def test_a_pull_whose_hold_ends_before_the_read_recomputes_and_later_pulls_run(pd, plain_server):
    """P checks the claim, queues the read, and NIXL's worker then finds D's deadline passed and
    fails the read. With the failure policy P runs ("recompute") vLLM 0.32 puts the turn back in
    the queue with its handle and upstream alone offers D's tokens again without reading them:
    the turn waited forever (docs/pd.md, "A pull that fails"). Here it is recomputed: the plain
    server's answer, in bounded time; a later pull still runs."""
    prefill, decode, router = pd
    messages, session, handle, turn2, expected = _held_turn(decode, plain_server, "late")
    empty_caches(prefill, P_RESET_WAIT_S)
    r = _claim(decode, handle)
    assert r.status_code == 200, r.text
    late = dict(handle, **{CLAIM_FIELD: _claim_past_its_read_deadline(dict(handle, **r.json()))})
    declined, expired = _declined(prefill), _reads_declined_as_expired(prefill)
    pool = concurrent.futures.ThreadPoolExecutor(1)
    turn = pool.submit(_at_p, prefill, decode, turn2, late)
    try:  # the bound: seconds of work (a failed read, a ~300-token prefill), not minutes
        r, answer = turn.result(timeout=180)
    except concurrent.futures.TimeoutError:
        pytest.fail("P's turn hangs after its failed pull (it waits for a read never queued)")
    finally:
        pool.shutdown(wait=False)  # a hung turn ends when the cluster stops
    assert answer == expected
    assert r.json()["kvbranch"]["remote_hit_tokens"] == 0
    assert _declined_since(prefill, declined) == {}  # passed every check of ours ...
    assert _reads_declined_as_expired(prefill) > expired  # ... and NIXL's worker failed it
    # A later pull from the same D: read, same answer.
    fresh = _held_handle(decode, messages, session)
    empty_caches(prefill, P_RESET_WAIT_S)
    r = _claim(decode, fresh)
    assert r.status_code == 200, r.text
    r, answer = _at_p(prefill, decode, turn2, dict(fresh, **r.json()))
    assert answer == expected
    assert r.json()["kvbranch"]["remote_hit_tokens"] > 0


def test_a_prefill_handle_for_another_prompt_is_not_read_by_d(pd, plain_server):
    prefill, decode, router = pd
    a = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Name a fruit."}]
    b = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Name a color."}]
    p_data = chat(
        prefill, a, max_tokens=1, kv_transfer_params={"do_remote_decode": True}, auth=as_router()
    )
    p_handle = p_data["kv_transfer_params"]
    assert p_handle.get("do_remote_prefill") and p_handle.get("remote_block_ids")
    before = _declined(decode)
    r = _post(decode, _body(decode, b, 16, kv_transfer_params=p_handle))
    assert r.status_code == 200, r.text  # D declined the handle and computed b itself
    assert sum(_declined_since(decode, before).values()) == 1, _declined_since(decode, before)
    assert r.json()["kvbranch"]["remote_hit_tokens"] == 0, r.json()["kvbranch"]
    assert text_of(r.json()) == text_of(chat(plain_server, b, max_tokens=16))
    # the right prompt still works (and is read from P)
    p_data = chat(
        prefill, a, max_tokens=1, kv_transfer_params={"do_remote_decode": True}, auth=as_router()
    )
    r = _post(decode, _body(decode, a, 16, kv_transfer_params=p_data["kv_transfer_params"]))
    assert r.status_code == 200, r.text
    assert r.json()["kvbranch"]["remote_hit_tokens"] > 0, r.json()["kvbranch"]
    assert text_of(r.json()) == text_of(chat(plain_server, a, max_tokens=16))


def test_router_refuses_client_transfer_params(pd):
    prefill, decode, router = pd
    r = _post(
        router,
        _body(
            router,
            [{"role": "user", "content": "hi"}],
            4,
            kv_transfer_params={"do_remote_decode": True},
        ),
    )
    assert r.status_code == 400 and "kv_transfer_params" in r.json()["error"]["message"]


# --- holds yield to new work --------------------------------------------------------------------
def test_held_conversations_yield_to_new_sessions(pd, plain_server):
    """6 sessions x 3 turns, 3 at a time, each holding ~5 of D's 18 blocks for 900 s: without
    releasing holds, new turns wait for the whole hold."""
    prefill, decode, router = pd
    released_before = _pd_stats(decode)["holds_released_for_new_work"]

    def agent(i: int) -> list[tuple[list[dict], str]]:
        messages = [
            {"role": "system", "content": system_prompt(words=150, seed=100 + i)},
            {"role": "user", "content": f"Agent {i}: plan a trip to city {i}."},
        ]
        out = []
        for turn in range(3):
            data = chat(router, messages, max_tokens=32, session_id=f"load{i}")
            out.append((list(messages), text_of(data)))
            messages += [
                {"role": "assistant", "content": text_of(data)},
                {"role": "user", "content": f"Observation {turn}: ok. Next step?"},
            ]
        return out

    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        results = list(pool.map(agent, range(6)))  # each call has a 600 s client timeout
    for turns in results:
        for messages, text in turns:
            assert text == text_of(chat(plain_server, messages, max_tokens=32))
    pd = _pd_stats(decode)
    assert pd["holds_released_for_new_work"] > released_before, pd  # by this load
