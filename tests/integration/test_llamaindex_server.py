"""KVBranchLLM against the real kvbranch server (real vLLM, model and connector): sync and
async chat/complete with streaming, the cache split across turns, a fork, and a FunctionAgent
tool-call round trip (with the background prefetch it triggers).

The bundled SmolLM2-135M answers in prose unless a tool call is forced: the agent forces the
first step (``initial_tool_choice``). The server marks the tool ``strict`` (the LLM sends no
``strict``: ``strict_tools=None``), so the call's arguments follow the tool's schema; were they
a bare value (``"Paris"``, as vLLM allows for a tool without ``strict``), the LLM would map it
onto the tool's single parameter."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("llama_index.core")

from llama_index.core.agent.workflow import (  # noqa: E402
    AgentOutput,
    FunctionAgent,
    ToolCallResult,
)
from llama_index.core.base.llms.types import ChatMessage, MessageRole  # noqa: E402

from integrations.llamaindex import KVBranchLLM  # noqa: E402
from sdk import KVBranchClient  # noqa: E402
from tests.integration.helpers import llm_kwargs  # noqa: E402

# Over two full 128-token KV blocks, so later turns can hit the caches. Kept plain: with some
# system prompts (mentioning tools, or how to phrase answers) the 135M model garbles forced
# tool arguments.
SYSTEM = (
    "You are a weather assistant. You answer questions about the weather in European "
    "cities such as Paris, Oslo, Rome, Lisbon, Vienna, Prague and Madrid. "
) * 8
MAX_TOKENS = 8
BLOCK = 128


def get_weather(city: str) -> str:
    """Get the current weather in a city."""
    return {"paris": "sunny, 21 C"}.get(str(city).strip().lower(), "cloudy, 15 C")


def make_llm(server, **kwargs) -> KVBranchLLM:
    kwargs.setdefault("max_tokens", MAX_TOKENS)
    return KVBranchLLM(**llm_kwargs(server), **kwargs)


def system() -> ChatMessage:
    return ChatMessage(role=MessageRole.SYSTEM, content=SYSTEM)


def user(text: str) -> ChatMessage:
    return ChatMessage(role=MessageRole.USER, content=text)


def reused(info: dict) -> int:
    split = info["kvbranch"]
    return split["device_hit_tokens"] + split["host_hit_tokens"]


def test_sync_chat_stream_and_complete(kvbranch_server):
    llm = make_llm(kvbranch_server)
    meta = llm.metadata
    assert meta.context_window == 4096  # the fixture's --max-model-len
    assert meta.model_name == kvbranch_server.model and meta.is_function_calling_model

    first = llm.chat([system(), user("Is it warm in Rome?")])
    assert first.message.content
    info = first.additional_kwargs
    assert info["kvbranch"]["session_id"] == llm.session_id
    assert info["kvbranch"]["branch_id"] == "main"
    assert info["prompt_tokens"] == info["kvbranch"]["prompt_tokens"] > 2 * BLOCK
    assert info["completion_tokens"] <= MAX_TOKENS

    # second turn, streamed: deltas add up; usage, split and TTFT come on the last response
    responses = list(
        llm.stream_chat(
            [system(), user("Is it warm in Rome?"), first.message, user("And in Oslo?")]
        )
    )
    last = responses[-1]
    assert "".join(r.delta or "" for r in responses) == last.message.content != ""
    info = last.additional_kwargs
    assert 0 < info["ttft_s"] <= info["latency_s"]
    assert info["cached_tokens"] >= 2 * BLOCK  # the first turn's blocks were reused
    assert reused(info) >= 2 * BLOCK
    assert llm.history[-1] == {"role": "assistant", "content": last.message.content}

    done = llm.complete("Name a city in Spain.")
    assert done.text and done.additional_kwargs["kvbranch"]["branch_id"] == "main"
    parts = list(llm.stream_complete("Name a city in Italy."))
    assert "".join(p.delta or "" for p in parts) == parts[-1].text != ""

    branch = llm.branch.info()
    assert branch is not None and branch.requests == 4
    llm.delete_session()
    llm.close()


def test_async_chat_stream_and_fork(kvbranch_server):
    llm = make_llm(kvbranch_server)

    async def run():
        first = await llm.achat([system(), user("Is it sunny in Lisbon?")])
        child = await llm.afork(branch_id="alt")
        stream = await child.astream_chat(
            [system(), user("Is it sunny in Lisbon?"), first.message, user("And in Vienna?")]
        )
        chunks = [r async for r in stream]
        cstream = await llm.astream_complete("Name a city in Austria.")
        cparts = [p async for p in cstream]
        branches = {b.branch_id: b for b in (await (await llm.abranch()).session.info()).branches}
        await llm.aclose()
        return first, child, chunks, cparts, branches

    first, child, chunks, cparts, branches = asyncio.run(run())
    assert first.message.content
    info = chunks[-1].additional_kwargs
    assert "".join(c.delta or "" for c in chunks) == chunks[-1].message.content != ""
    assert info["kvbranch"]["branch_id"] == "alt" == child.branch_id
    assert info["kvbranch"]["session_id"] == llm.session_id
    assert reused(info) >= 2 * BLOCK  # the fork shares main's cached prefix
    assert cparts[-1].text and cparts[-1].additional_kwargs["ttft_s"] > 0
    assert set(branches) == {"main", "alt"}
    assert branches["alt"].parent == "main" and branches["alt"].requests == 1
    llm.delete_session()


def test_function_agent_tool_round_trip(kvbranch_server):
    # a forced tool call takes ~50 tokens with this model (guided JSON)
    llm = make_llm(kvbranch_server, max_tokens=64)
    with KVBranchClient(kvbranch_server.url, api_key=kvbranch_server.api_key) as client:
        before = client.stats()
        prefetches_before = before.prefetches + before.prefetches_skipped
    agent = FunctionAgent(
        tools=[get_weather], llm=llm, system_prompt=SYSTEM, initial_tool_choice="get_weather"
    )

    async def run():
        handler = agent.run("What is the weather in Paris?")
        events = [
            ev
            async for ev in handler.stream_events()
            if isinstance(ev, (AgentOutput, ToolCallResult))
        ]
        answer = await handler
        await llm.await_prefetch()
        await llm.aclose()
        return events, answer

    events, answer = asyncio.run(run())
    outputs = [e for e in events if isinstance(e, AgentOutput)]
    results = [e for e in events if isinstance(e, ToolCallResult)]
    assert len(outputs) == 2 and len(results) == 1
    call = outputs[0].tool_calls[0]
    assert call.tool_name == "get_weather"
    assert set(call.tool_kwargs) == {"city"} and isinstance(call.tool_kwargs["city"], str)
    assert results[0].tool_output.content == get_weather(call.tool_kwargs["city"])
    assert not results[0].tool_output.is_error
    assert str(answer.response.content or "").strip()
    # the conversation the LLM saw, on its session's main branch
    assert [m["role"] for m in llm.history] == ["system", "user", "assistant", "tool", "assistant"]
    assert llm.history[2]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert llm.history[3]["content"] == results[0].tool_output.content
    # the last stream chunk (AgentOutput.raw) carries the split: the answer step reused the
    # tool-call step's blocks
    first_split, second_split = (o.raw["kvbranch"] for o in outputs)
    assert first_split["session_id"] == second_split["session_id"] == llm.session_id
    assert second_split["device_hit_tokens"] + second_split["host_hit_tokens"] >= 2 * BLOCK
    # the tool call prefetched the branch in the background
    with KVBranchClient(kvbranch_server.url, api_key=kvbranch_server.api_key) as client:
        after = client.stats()  # skipped when the branch was still device-resident
        assert after.prefetches + after.prefetches_skipped > prefetches_before
    llm.delete_session()
