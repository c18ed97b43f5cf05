"""Real agent frameworks end to end on the real kvbranch server (real vLLM, model, connector),
built with the examples' own code so that the examples are what is tested:

* LangGraph: the prebuilt ReAct graph with an ``InMemorySaver`` over ``ChatKVBranch``
  (``examples/langgraph_agent.py``): the thread is the session, so its second turn reuses the
  first turn's KV; time travel to the checkpoint after turn 1 runs on a branch of its own,
  forked on the server from ``main``.
* LlamaIndex: ``ReActAgent`` (prose tool use, guided by a regular expression) and
  ``FunctionAgent`` (a strict tool) over ``KVBranchLLM`` with a ``Memory`` across turns
  (``examples/llamaindex_agent.py``), the FunctionAgent's conversation also forked.
* LangChain: the forced, strict tool call of ``examples/langchain_agent.py``.

Every tool call's arguments must validate against the tool's JSON schema (the bundled 135M
model writes bare strings without guided decoding), answers must be non-empty, and reuse is read
from the server's own accounting (the ``kvbranch`` split: device + host tokens). A unique
conversation tag at the start of each system prompt keeps other tests' caches out of the
numbers.
"""

from __future__ import annotations

import uuid

import jsonschema
from langchain_core.messages import (
    AIMessage,
    HumanMessage,
    SystemMessage,
    ToolMessage,
)
from langchain_core.utils.function_calling import convert_to_openai_tool
from langgraph.checkpoint.memory import InMemorySaver
from llama_index.core.memory import Memory

from examples import langchain_agent, langgraph_agent, llamaindex_agent
from examples._common import reused_tokens  # noqa: E402
from integrations.langchain import ChatKVBranch  # noqa: E402
from integrations.llamaindex import KVBranchLLM  # noqa: E402
from tests.integration.helpers import llm_kwargs, reset_device_cache  # noqa: E402

BLOCK = 128
MAX_TOKENS = 48


def tagged(system: str) -> str:
    """``system`` behind a tag no other prompt has: the first call of a conversation finds
    no whole block cached (only the few template tokens before the tag may match a stored
    tail), and whatever later calls reuse was cached by this conversation."""
    return f"Conversation {uuid.uuid4().hex}. " + system


def shared_prefix(prompt_tokens: int) -> int:
    """Tokens of a ``prompt_tokens`` prompt that a later prompt starting with it must find in
    the caches: its whole KV blocks (less a few tokens of slack for the template's edge)."""
    return BLOCK * ((prompt_tokens - 8) // BLOCK)


# --- LangGraph ------------------------------------------------------------------------------


def lg_split(message: AIMessage) -> dict:
    split = message.response_metadata["kvbranch"]
    assert split["prompt_tokens"] == message.usage_metadata["input_tokens"]
    return split


def check_lg_turn(new: list, schema: dict) -> tuple[AIMessage, AIMessage]:
    """A turn of the ReAct graph: a schema-valid tool call, its result, a prose answer."""
    calls = langgraph_agent.model_calls(new)
    assert len(calls) == 2, [m.content for m in new]
    call, answer = calls
    assert not call.invalid_tool_calls and len(call.tool_calls) == 1
    assert call.tool_calls[0]["name"] == "get_weather"
    jsonschema.validate(call.tool_calls[0]["args"], schema)
    assert str(answer.content).strip() and not answer.tool_calls
    return call, answer


def lc_model(server, **kwargs) -> ChatKVBranch:
    return ChatKVBranch(**llm_kwargs(server), max_tokens=MAX_TOKENS, **kwargs)


def test_langgraph_react_agent_thread_reuse_and_time_travel(kvbranch_server):
    llm = lc_model(kvbranch_server)
    graph = langgraph_agent.build_agent(
        llm, system=tagged(langgraph_agent.SYSTEM), checkpointer=InMemorySaver()
    )
    schema = convert_to_openai_tool(langgraph_agent.get_weather)["function"]["parameters"]
    thread_id = f"lg-it-{uuid.uuid4().hex[:8]}"
    thread = {"configurable": {"thread_id": thread_id}}

    first_call, first_answer = check_lg_turn(
        langgraph_agent.ask(graph, thread, "What is the weather in Paris today?"), schema
    )
    assert reused_tokens(lg_split(first_call)) < BLOCK  # cold: no block of it was cached
    for message in (first_call, first_answer):
        meta = message.response_metadata
        assert (meta["session_id"], meta["branch_id"]) == (thread_id, "main")
    after_first = len(graph.get_state(thread).values["messages"])
    turn1_prompt = lg_split(first_answer)["prompt_tokens"]
    assert shared_prefix(turn1_prompt) >= 2 * BLOCK

    # resuming the thread: same session and branch; its first call reuses turn 1's KV, from
    # the host store alone (vLLM's own prefix cache would have it too)
    reset_device_cache(kvbranch_server)
    second_call, _ = check_lg_turn(
        langgraph_agent.ask(graph, thread, "What is the weather in Lyon today?"), schema
    )
    assert (
        second_call.response_metadata["session_id"],
        second_call.response_metadata["branch_id"],
    ) == (thread_id, "main")
    assert reused_tokens(lg_split(second_call)) >= shared_prefix(turn1_prompt)
    assert lg_split(second_call)["host_hit_tokens"] >= shared_prefix(turn1_prompt)

    # time travel: a run from the checkpoint after turn 1 is on a branch forked from main
    snapshot = langgraph_agent.checkpoint_after(graph, thread, after_first)
    checkpoint_id = snapshot.config["configurable"]["checkpoint_id"]
    fork_call, fork_answer = check_lg_turn(
        langgraph_agent.ask(graph, snapshot.config, "What is the weather in Geneva today?"), schema
    )
    for message in (fork_call, fork_answer):
        meta = message.response_metadata
        assert (meta["session_id"], meta["branch_id"]) == (thread_id, f"ckpt-{checkpoint_id}")
    assert reused_tokens(lg_split(fork_call)) >= shared_prefix(turn1_prompt)
    branches = {b.branch_id: b for b in llm.client.list_branches(thread_id)}
    fork = branches[f"ckpt-{checkpoint_id}"]
    assert fork.parent == "main" and fork.fork_offset_tokens > 0
    assert fork.requests == 2 and branches["main"].requests == 4
    llm.delete_session(config=thread)
    llm.close()


# --- LlamaIndex -----------------------------------------------------------------------------


def li_llm(server, cls: type[KVBranchLLM] = KVBranchLLM, **kwargs) -> KVBranchLLM:
    return cls(**llm_kwargs(server), max_tokens=96, **kwargs)


def check_li_turn(done: llamaindex_agent.Turn, schemas: dict) -> None:
    """A schema-valid tool call, then an answer (one LLM call each)."""
    assert len(done.tool_calls) == 1 and len(done.splits) == 2, done
    call = done.tool_calls[0]
    assert not call.tool_output.is_error, call.tool_output
    jsonschema.validate(call.tool_kwargs, schemas[call.tool_name])
    assert done.answer


def memory() -> Memory:
    return Memory.from_defaults(session_id=uuid.uuid4().hex, token_limit=3500)


async def test_llamaindex_react_agent_memory_and_reuse(kvbranch_server):
    tools = [llamaindex_agent.strict_tool(llamaindex_agent.get_weather)]
    schemas = llamaindex_agent.tool_parameters(tools)
    llm = li_llm(kvbranch_server, llamaindex_agent.ReActGuidedLLM, react_tools=schemas)
    agent = llamaindex_agent.react_agent(llm, tools, tagged(llamaindex_agent.SYSTEM))
    mem = memory()

    first = await llamaindex_agent.turn(agent, mem, "What is the weather in Paris?")
    check_li_turn(first, schemas)
    reset_device_cache(kvbranch_server)  # turn 1's KV from the host store alone
    second = await llamaindex_agent.turn(agent, mem, "What is the weather in Oslo?")
    check_li_turn(second, schemas)

    history = await mem.aget_all()
    assert [m.role.value for m in history] == ["user", "assistant"] * 2
    assert history[0].content == "What is the weather in Paris?"
    assert first.answer in str(history[1].content)
    # turn 2's prompt starts with turn 1's first prompt (header, tools, question 1)
    for split in first.splits + second.splits:
        assert split["session_id"] == llm.session_id and split["branch_id"] == "main"
    assert reused_tokens(second.splits[0]) >= shared_prefix(first.splits[0]["prompt_tokens"])
    assert shared_prefix(first.splits[0]["prompt_tokens"]) >= 4 * BLOCK
    llm.delete_session()
    await llm.aclose()


async def test_llamaindex_function_agent_memory_reuse_and_fork(kvbranch_server):
    tools = [llamaindex_agent.strict_tool(llamaindex_agent.get_weather)]
    schemas = llamaindex_agent.tool_parameters(tools)
    assert tools[0].metadata.to_openai_tool()["function"]["strict"] is True
    system = tagged(llamaindex_agent.SYSTEM * 2)
    llm = li_llm(kvbranch_server)
    agent = llamaindex_agent.function_agent(llm, tools, system)
    mem = memory()

    first = await llamaindex_agent.turn(agent, mem, "What is the weather in Paris?")
    check_li_turn(first, schemas)
    assert reused_tokens(first.splits[0]) < BLOCK  # cold: no block of it was cached
    reset_device_cache(kvbranch_server)  # turn 1's KV from the host store alone
    second = await llamaindex_agent.turn(agent, mem, "What is the weather in Oslo?")
    check_li_turn(second, schemas)
    assert [m.role.value for m in await mem.aget_all()][:1] == ["user"]
    turn1_prompt = first.splits[-1]["prompt_tokens"]
    assert shared_prefix(turn1_prompt) >= 2 * BLOCK
    assert reused_tokens(second.splits[0]) >= shared_prefix(turn1_prompt)
    assert second.splits[0]["host_hit_tokens"] >= shared_prefix(turn1_prompt)

    # a fork of the conversation: a new branch that finds the history so far cached
    alt_llm = await llm.afork()
    alt_memory = memory()
    await alt_memory.aput_messages(await mem.aget_all())
    third = await llamaindex_agent.turn(
        llamaindex_agent.function_agent(alt_llm, tools, system),
        alt_memory,
        "What is the weather in Rome?",
    )
    check_li_turn(third, schemas)
    assert {s["branch_id"] for s in third.splits} == {alt_llm.branch_id} != {"main"}
    assert reused_tokens(third.splits[0]) >= shared_prefix(second.splits[-1]["prompt_tokens"])
    branches = {b.branch_id: b for b in llm.session.info().branches}
    assert branches[alt_llm.branch_id].parent == "main"
    llm.delete_session()
    await llm.aclose()


# --- LangChain ------------------------------------------------------------------------------


def test_langchain_strict_tool_call(kvbranch_server):
    llm = lc_model(kvbranch_server, auto_session=True)
    schema = convert_to_openai_tool(langchain_agent.get_weather)["function"]["parameters"]
    history: list = [SystemMessage(tagged(langchain_agent.SYSTEM))]
    call = langchain_agent.tool_turn(llm, history, "Geneva", "tool")
    assert not call.invalid_tool_calls and len(call.tool_calls) == 1
    jsonschema.validate(call.tool_calls[0]["args"], schema)
    assert [type(m) for m in history[1:]] == [HumanMessage, AIMessage, ToolMessage, AIMessage]
    city = call.tool_calls[0]["args"]["city"]
    assert history[3].content == langchain_agent.WEATHER[city]  # the call the model wrote ran
    answer = history[-1]
    assert str(answer.content).strip() and not answer.tool_calls
    assert reused_tokens(answer.response_metadata["kvbranch"]) >= shared_prefix(
        call.response_metadata["kvbranch"]["prompt_tokens"]
    )
    llm.delete_session()
    llm.close()
