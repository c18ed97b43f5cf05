"""The sdk against the real kvbranch server (real vLLM, model and connector): the whole session
flow, and a conversation that survives a server restart with the same greedy answers."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from sdk import AsyncKVBranchClient, KVBranchClient, NotFoundError
from tests.integration.helpers import chat, text_of

# Long enough for several full 128-token blocks, so later turns can hit the caches.
SYSTEM = (
    "You are a concise assistant for a small bakery. Answer in one short sentence. "
    "The bakery sells bread, croissants, cakes and coffee, opens at seven in the "
    "morning, closes at six in the evening, and is closed on Mondays. "
) * 6
MAX_TOKENS = 12


def make_client(server) -> KVBranchClient:
    return KVBranchClient(server.url, api_key=server.api_key, model=server.model, timeout=120)


def test_session_flow(kvbranch_server, plain_server):
    with make_client(kvbranch_server) as client:
        before = client.stats()
        assert client.kvbranch_available()
        assert client.health().connector.loaded
        session = client.session(system=SYSTEM, pin_ttl_s=600)
        main = session.main

        first = main.chat("When do you open?", max_tokens=MAX_TOKENS, temperature=0)
        assert first.text and first.finish_reason in ("stop", "length")
        assert first.model == kvbranch_server.model
        assert first.split is not None and first.split.session_id == session.session_id
        assert first.split.branch_id == "main"
        assert first.split.prompt_tokens == first.usage.prompt_tokens > 256

        # second turn, streamed: deltas add up to the answer; usage and split arrive last
        stream = main.chat_stream("Are you open on Mondays?", max_tokens=MAX_TOKENS, temperature=0)
        chunks = list(stream)
        second = stream.result
        assert "".join(c.content or "" for c in chunks) == second.text != ""
        assert chunks[-1].usage is not None and chunks[-1].split is not None
        assert stream.ttft_s is not None and 0 < stream.ttft_s <= second.latency_s
        # the system prompt's blocks were reused from the first turn
        assert second.usage.cached_tokens >= 256
        assert len(main) == 5 and main.messages[-1]["content"] == second.text

        # fork after the first answer; pin it
        child = main.fork(at_message=3, branch_id="alt")
        assert child.messages == main.messages[:3]
        pinned = child.pin(300)
        assert pinned.pinned and pinned.branch_id == "alt"
        # the server forked its token sequence where those messages end: the system prompt
        # and the first exchange are shared with main
        assert pinned.fork_offset_tokens >= first.usage.prompt_tokens - 8
        branch_ids = {b.branch_id for b in client.list_branches(session.session_id)}
        assert branch_ids == {"main", "alt"}

        # drop the device cache: the child's shared prefix must come from the host store
        httpx.post(
            f"{kvbranch_server.url}/reset_prefix_cache",
            headers=kvbranch_server.headers(),
            timeout=30,
        ).raise_for_status()
        before_third = client.stats()
        third = child.chat("Do you sell cakes?", max_tokens=MAX_TOKENS, temperature=0)
        after_third = client.stats()
        assert third.split.branch_id == "alt"
        assert third.split.host_hit_tokens >= 256, third.split
        assert (
            third.split.device_hit_tokens
            + third.split.host_hit_tokens
            + third.split.recomputed_tokens
        ) == third.split.prompt_tokens
        # the server's counters moved by this one request and its host-store load
        assert after_third.requests - before_third.requests == 1
        host_loaded = after_third.hits_tokens["host"] - before_third.hits_tokens["host"]
        assert host_loaded == third.split.host_hit_tokens

        # greedy answers do not depend on where the KV came from: plain vLLM (no connector,
        # so no host store, and a device cache that never saw these blocks) gives the same
        # text, and so do the same prompt sent again without a session (another client too,
        # async and streamed)
        reference = text_of(chat(plain_server, child.messages[:-1], max_tokens=MAX_TOKENS))
        assert third.text == reference
        plain = client.chat(child.messages[:-1], max_tokens=MAX_TOKENS, temperature=0)
        assert plain.text == reference

        async def streamed() -> str:
            async with AsyncKVBranchClient(
                kvbranch_server.url, api_key=kvbranch_server.api_key, timeout=120
            ) as aclient:
                s = await aclient.chat_stream(
                    child.messages[:-1], max_tokens=MAX_TOKENS, temperature=0
                )
                return (await s.final()).text

        assert asyncio.run(streamed()) == reference

        prefetch = main.prefetch()
        # the branch was just used: still device-resident or all in the host store, so nothing
        # runs; to_device runs it in the engine unless the device cache holds it
        assert prefetch.status in {"already_resident", "in_host_store"}
        assert prefetch.num_tokens > 256
        assert main.prefetch(to_device=True).status in {"scheduled", "already_resident"}

        stats = client.stats()
        # five chat requests (first, second, third, plain, streamed); prefetches count apart
        assert stats.requests - before.requests == 5
        assert stats.hits_tokens["host"] - before.hits_tokens["host"] >= host_loaded
        assert session.session_id in {s.session_id for s in stats.sessions}

        session.delete()
        with pytest.raises(NotFoundError, match="not found"):
            client.get_session(session.session_id)


def test_conversation_survives_a_restart(kvbranch_server):
    with make_client(kvbranch_server) as client:
        session = client.session("sdk-restart", system=SYSTEM)
        main = session.main
        main.chat("When do you open?", max_tokens=MAX_TOKENS, temperature=0)
        main.chat("And when do you close?", max_tokens=MAX_TOKENS, temperature=0)
        twin = main.fork(branch_id="twin")  # the same history, answered before the restart
        before = twin.chat("Do you sell coffee?", max_tokens=MAX_TOKENS, temperature=0)
        assert before.usage.cached_tokens >= 256  # served from the caches

        kvbranch_server.restart()  # the server forgets sessions, branches and all caches

        after = main.chat("Do you sell coffee?", max_tokens=MAX_TOKENS, temperature=0)
        assert after.text == before.text
        assert after.split.host_hit_tokens == 0 and after.split.device_hit_tokens == 0
        assert after.split.session_id == "sdk-restart"

        # the twin branch is unknown to the restarted server: restored from client history
        result = twin.prefetch()
        assert session.recoveries == 1 and result is not None
        assert twin.info().branch_id == "twin"
        again = twin.chat("Thanks!", max_tokens=MAX_TOKENS, temperature=0)
        assert again.text and len(twin) == 9 and again.split.branch_id == "twin"
