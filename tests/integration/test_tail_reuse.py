"""Token-exact reuse (issue 14 item 1) on the real server: a finished turn's tail — the partial
last block of its prompt plus the reply tokens whose KV was computed — is kept in the host
store and loaded when the next prompt repeats it, so a turn recomputes about its new tokens
only, not the previous turn's partial block and reply.

Correctness against plain vLLM (greedy, token for token), also when the host store is the only
source (device prefix cache reset before each turn), and when the history diverges inside the
cached tail (an edited last assistant message, a regeneration): those load only the matching
prefix and recompute the rest.

The per-turn numbers are printed (``-s``) for benchmarks/RESULTS.md; no timing is asserted.
"""

from __future__ import annotations

from tests.integration.helpers import (
    BLOCK,
    chat,
    client,
    reset_device_cache,
    system_prompt,
    text_of,
)

TURNS = [
    "Tool result: weather in Paris is 18C, light rain, wind 12 km/h, humidity 80 percent.",
    "Tool result: the flight AF1234 departs 09:40 from gate K32, boarding 09:10, on time.",
    "Tool result: hotel Le Marais has 3 rooms left at 142 EUR per night, breakfast included.",
    "Tool result: the museum opens at 10:00, tickets 17 EUR, closed on Tuesdays.",
    "Tool result: taxi from CDG to the city centre costs a flat 56 EUR, about 45 minutes.",
    "Tool result: the restaurant has a table for two at 20:30, tasting menu 95 EUR.",
]
#: Template glue the chat format adds between a reply and the next user message, plus the
#: reply's last sampled token (it has no KV, so the next turn computes it).
GLUE = 8


def _conversation(server, session, *, reset_between=False, seed=3, max_tokens=24):
    """Six agent turns; per turn: (text, response, tokens the turn adds to the history)."""
    messages = [{"role": "system", "content": system_prompt(words=300, seed=seed)}]
    rows = []
    known = 0
    for turn, observation in enumerate(TURNS):
        messages.append({"role": "user", "content": f"Step {turn}. {observation} What next?"})
        if reset_between:
            reset_device_cache(server)
        response = chat(server, messages, session=session, max_tokens=max_tokens)
        usage = response["usage"]
        rows.append((text_of(response), response, usage["prompt_tokens"] - known))
        known = usage["prompt_tokens"] + usage["completion_tokens"]
        messages.append({"role": "assistant", "content": text_of(response)})
    return rows, messages


def test_each_turn_recomputes_about_its_new_tokens_and_answers_like_plain(
    kvbranch_server, plain_server
):
    rows, _ = _conversation(kvbranch_server, "tail-s")
    plain_rows, _ = _conversation(plain_server, None)
    assert [r[0] for r in rows] == [r[0] for r in plain_rows]
    print("\nturn  prompt  new  device  host  recomputed")
    for turn, (_, response, new) in enumerate(rows):
        split = response["kvbranch"]
        print(
            f"{turn + 1:>4} {split['prompt_tokens']:>7} {new:>4} {split['device_hit_tokens']:>7}"
            f" {split['host_hit_tokens']:>5} {split['recomputed_tokens']:>11}"
        )
    for _, response, new in rows[1:]:
        split = response["kvbranch"]
        assert split["recomputed_tokens"] <= new + GLUE, split
    # the history past the last full block came from stored tails: loads that end inside a
    # block (a turn whose history ended on a block boundary has no tail to load)
    assert any(r[1]["kvbranch"]["host_hit_tokens"] % BLOCK for r in rows[1:])


def test_store_only_turns_are_token_exact_and_identical_to_plain(kvbranch_server, plain_server):
    rows, _ = _conversation(kvbranch_server, "tail-store-s", reset_between=True, seed=4)
    plain_rows, _ = _conversation(plain_server, None, seed=4)
    assert [r[0] for r in rows] == [r[0] for r in plain_rows]
    for _, response, new in rows[1:]:
        split = response["kvbranch"]
        assert split["device_hit_tokens"] == 0, split
        assert split["recomputed_tokens"] <= new + GLUE, split
        assert (
            response["usage"]["prompt_tokens_details"]["cached_tokens"] == split["host_hit_tokens"]
        )


def _tail_start(response) -> int:
    """Where the turn's tail starts: the last block boundary below its computed tokens."""
    usage = response["usage"]
    return (usage["prompt_tokens"] + usage["completion_tokens"] - 1) // BLOCK * BLOCK


def test_history_diverging_inside_the_tail_recomputes_and_stays_identical(
    kvbranch_server, plain_server
):
    rows, history = _conversation(kvbranch_server, "tail-edit-s", seed=5)
    last = rows[-1][1]
    prompt_tokens = last["usage"]["prompt_tokens"]

    # Edited last assistant message: the history diverges where the reply starts to differ.
    edited = history[:-1] + [
        {"role": "assistant", "content": "Book the table, then rest."},
        {"role": "user", "content": "And after dinner?"},
    ]
    reset_device_cache(kvbranch_server)
    ours = chat(kvbranch_server, edited, session="tail-edit-s", max_tokens=24)
    plain = chat(plain_server, edited, max_tokens=24)
    assert text_of(ours) == text_of(plain)
    split = ours["kvbranch"]
    # the edited reply and the new user message are recomputed, not loaded from the old reply
    assert split["recomputed_tokens"] > 10, split
    if _tail_start(last) < prompt_tokens:  # the old tail holds the prompt's end: its prefix loads
        assert split["host_hit_tokens"] > _tail_start(last), split

    # Regeneration: the same prompt as the last turn again; the stored tail goes past it, so
    # only the prompt's own tokens (all but the last) load.
    reset_device_cache(kvbranch_server)
    again = chat(kvbranch_server, history[:-1], max_tokens=24)
    plain_again = chat(plain_server, history[:-1], max_tokens=24)
    assert text_of(again) == text_of(plain_again) == rows[-1][0]
    split = again["kvbranch"]
    assert split["recomputed_tokens"] == 1, split  # the last prompt token, computed by vLLM


def test_fork_inside_the_tail_gets_only_matching_tokens(kvbranch_server, plain_server):
    rows, history = _conversation(kvbranch_server, "tail-fork-s", seed=6)
    fork_point = history[:-2]  # up to the previous turn's reply
    with client(kvbranch_server) as c:
        r = c.post(
            "/v1/kvbranch/sessions/tail-fork-s/branches",
            json={"parent": "main", "branch_id": "alt", "messages": fork_point},
        )
        assert r.status_code == 201, r.text
        fork = r.json()
    assert fork["pinned_blocks"] >= 1
    alt = fork_point + [{"role": "user", "content": "Instead, find a cheaper hotel."}]
    reset_device_cache(kvbranch_server)
    ours = chat(kvbranch_server, alt, session="tail-fork-s", branch="alt", max_tokens=24)
    plain = chat(plain_server, alt, max_tokens=24)
    assert text_of(ours) == text_of(plain)
    assert ours["kvbranch"]["device_hit_tokens"] == 0
    assert ours["kvbranch"]["host_hit_tokens"] >= BLOCK
