"""Issue 22 against the real engine: the host store never serves KV a request must not read.

* prompt logprobs (and ``echo`` + ``logprobs`` on ``/v1/completions``) need every prompt
  position computed: no host-store load, and the same prompt logprobs as plain vLLM;
* ``POST /reset_prefix_cache?reset_external=true`` forgets pinned blocks and tails and the pins;
* new weights (``POST /collective_rpc`` ``reload_weights``, dev mode) clear the store.
"""

from __future__ import annotations

import time

from tests.integration.helpers import (
    BLOCK,
    branch_info,
    chat,
    client,
    reset_device_cache,
    stats,
    system_prompt,
    text_of,
)


def _messages(seed: int, words: int = 450) -> list[dict]:
    return [
        {"role": "system", "content": system_prompt(words=words, seed=seed)},
        {"role": "user", "content": "Name one tool an agent may call."},
    ]


def _reset_external(server) -> None:
    with client(server) as c:
        for _ in range(50):
            r = c.post("/reset_prefix_cache", params={"reset_external": "true"})
            if r.status_code == 200 and r.json().get("success"):
                return
            time.sleep(0.2)
    raise AssertionError("reset_prefix_cache?reset_external=true did not succeed")


#: Two servers batch and schedule differently: the same greedy computation's logprobs agree to
#: about 1e-3 (seen: -2.678 vs -2.677), not bit for bit.
LOGPROB_TOL = 0.01


def _prompt_logprobs(response: dict) -> list:
    """Per prompt position: the (token id, logprob) pairs vLLM returned."""
    out = []
    for entry in response["prompt_logprobs"]:
        if entry is None:
            out.append(None)
            continue
        out.append(sorted((int(k), v["logprob"]) for k, v in entry.items()))
    return out


def _close(ours: list, theirs: list) -> bool:
    """Same positions and token ids, logprobs within :data:`LOGPROB_TOL`."""
    if len(ours) != len(theirs):
        return False
    for a, b in zip(ours, theirs, strict=True):
        if (a is None) != (b is None):
            return False
        if a is None:
            continue
        if isinstance(a, float):
            if abs(a - b) > LOGPROB_TOL:
                return False
            continue
        if [t for t, _ in a] != [t for t, _ in b]:
            return False
        if any(abs(x - y) > LOGPROB_TOL for (_, x), (_, y) in zip(a, b, strict=True)):
            return False
    return True


def test_prompt_logprobs_load_nothing_from_the_host_store(kvbranch_server, plain_server):
    messages = _messages(seed=221)
    warm = chat(kvbranch_server, messages, session="fresh-logprobs", max_tokens=4)
    assert warm["usage"]["prompt_tokens"] > 2 * BLOCK
    # The control: without prompt logprobs, the prefix now comes from the host store.
    reset_device_cache(kvbranch_server)
    control = chat(kvbranch_server, messages, max_tokens=4)
    assert control["kvbranch"]["host_hit_tokens"] >= BLOCK
    reset_device_cache(kvbranch_server)
    ours = chat(kvbranch_server, messages, max_tokens=4, prompt_logprobs=1)
    theirs = chat(plain_server, messages, max_tokens=4, prompt_logprobs=1)
    split = ours["kvbranch"]
    assert split["host_hit_tokens"] == 0 and split["device_hit_tokens"] == 0
    assert split["recomputed_tokens"] == ours["usage"]["prompt_tokens"]
    assert len(ours["prompt_logprobs"]) == ours["usage"]["prompt_tokens"]
    assert _close(_prompt_logprobs(ours), _prompt_logprobs(theirs))
    assert text_of(ours) == text_of(theirs)


def test_echo_with_logprobs_on_completions_loads_nothing(kvbranch_server, plain_server):
    prompt = system_prompt(seed=222) + "\nThe first tool is"
    body = {"model": kvbranch_server.model, "prompt": prompt, "max_tokens": 2, "temperature": 0}
    with client(kvbranch_server) as c:
        assert c.post("/v1/completions", json=body).status_code == 200
        reset_device_cache(kvbranch_server)
        control = c.post("/v1/completions", json=body).json()
        assert control["kvbranch"]["host_hit_tokens"] >= BLOCK
        reset_device_cache(kvbranch_server)
        ours = c.post("/v1/completions", json={**body, "echo": True, "logprobs": 1}).json()
    with client(plain_server) as c:
        theirs = c.post(
            "/v1/completions",
            json={**body, "model": plain_server.model, "echo": True, "logprobs": 1},
        ).json()
    assert ours["kvbranch"]["host_hit_tokens"] == 0
    mine, plain = ours["choices"][0]["logprobs"], theirs["choices"][0]["logprobs"]
    assert mine["tokens"] == plain["tokens"]
    assert _close(mine["token_logprobs"], plain["token_logprobs"])


def test_reset_external_drops_pinned_blocks_tails_and_pins(kvbranch_server):
    # Small enough for the test server's pin budget (9 blocks; 450 words are 11 blocks), and
    # from an empty store: earlier tests' pins would fill that budget, and this branch's
    # auto-pin would degrade to LRU retention.
    messages = _messages(seed=223, words=180)
    _reset_external(kvbranch_server)
    first = chat(kvbranch_server, messages, session="fresh-pins", max_tokens=8)
    before = branch_info(kvbranch_server, "fresh-pins")
    assert before["pinned"] and before["stored_blocks"] > 0
    _reset_external(kvbranch_server)
    after = branch_info(kvbranch_server, "fresh-pins")  # the session stays
    assert not after["pinned"] and after["stored_blocks"] == 0 and after["pinned_blocks"] == 0
    store = stats(kvbranch_server)["store"]
    assert store["used_blocks"] == 0 and store["pinned_blocks"] == 0
    # Nothing of the old KV is served: the same prompt recomputes everything.
    reset_device_cache(kvbranch_server)
    again = chat(kvbranch_server, messages, session="fresh-pins", max_tokens=8)
    assert again["kvbranch"]["host_hit_tokens"] == 0
    assert text_of(again) == text_of(first)
    assert branch_info(kvbranch_server, "fresh-pins")["pinned"]  # pinned again by its use


def test_new_weights_clear_the_host_store(kvbranch_server):
    messages = _messages(seed=224)
    first = chat(kvbranch_server, messages, session="fresh-weights", max_tokens=8)
    assert stats(kvbranch_server)["store"]["used_blocks"] > 0
    with client(kvbranch_server) as c:
        r = c.post("/collective_rpc", json={"method": "reload_weights"})
    # the tests' servers run in dev mode (tests/server_process.py): the route must be there
    assert r.status_code == 200, r.text
    store = stats(kvbranch_server)["store"]
    assert store["used_blocks"] == 0 and store["pinned_blocks"] == 0
    reset_device_cache(kvbranch_server)
    again = chat(kvbranch_server, messages, session="fresh-weights", max_tokens=8)
    assert again["kvbranch"]["host_hit_tokens"] == 0
    assert text_of(again) == text_of(first)  # the same weights were reloaded
