"""A LangGraph ReAct agent (the prebuilt ``create_react_agent`` graph with an ``InMemorySaver``
checkpointer) on kvbranch: two turns of one thread, then time travel to the checkpoint after
the first turn, printing for every model call its kvbranch branch and where its prompt tokens
came from (device prefix cache / kvbranch host store / recomputed).

    python -m server --port 8000 &                      # a kvbranch server
    python examples/langgraph_agent.py --base-url http://127.0.0.1:8000
    python examples/langgraph_agent.py                  # starts (and stops) its own server

No kvbranch code in the graph: ``ChatKVBranch`` maps LangGraph's ids itself. The ``thread_id``
is the kvbranch session, so resuming the thread reuses its cached KV; a run started from an
earlier checkpoint (time travel) goes to a branch of its own (``ckpt-<checkpoint id>``), forked
on the server from ``main`` where the prompts agree.

The bundled 135M model answers in prose when it may choose, so the model node forces the tool
on the first step of a turn (a named ``tool_choice``) and answers after the tool result. The
tool is ``strict``: vLLM then constrains its arguments by the tool's JSON schema (guided
decoding), here an enum of the cities the tool knows, instead of letting the small model
write a bare string. Needs the ``langgraph`` extra (langchain-core, langgraph).
"""

from __future__ import annotations

import secrets
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, ToolMessage  # noqa: E402
from langchain_core.tools import tool  # noqa: E402
from langgraph.checkpoint.memory import InMemorySaver  # noqa: E402
from langgraph.prebuilt import create_react_agent  # noqa: E402

from examples._common import example_parser, model_args, run, server_url, split_line  # noqa: E402
from integrations.langchain import ChatKVBranch  # noqa: E402

WEATHER = {
    "Paris": "sunny, 21 C",
    "Lyon": "sunny, 24 C",
    "Geneva": "light rain, 17 C",
    "Turin": "cloudy, 19 C",
}

# Long enough to fill whole 128-token KV blocks, so later calls can reuse them.
SYSTEM = (
    "You are a travel assistant for a rail traveller. Answer in one or two short "
    "sentences. The traveller likes museums, trains, small hotels and local food, "
    "dislikes flying, and travels in late spring with a carry-on bag only. "
) * 5

#: A forced call with its JSON envelope takes about 60 tokens with the bundled model.
TOOL_CALL_TOKENS = 96


@tool
def get_weather(city: Literal["Paris", "Lyon", "Geneva", "Turin"]) -> str:
    """Get today's weather in a city."""
    return WEATHER[city]


TOOLS = [get_weather]


def build_agent(llm: ChatKVBranch, *, system: str = SYSTEM, checkpointer: Any = None) -> Any:
    """The prebuilt ReAct graph (model node ⇄ tool node) with a checkpointer. The model node
    picks its binding per step: a turn's first step must call ``get_weather`` (strict schema,
    guided decoding); the step after the tool result answers in prose."""
    call_tool = llm.bind_tools(
        TOOLS, tool_choice="get_weather", strict=True, max_tokens=TOOL_CALL_TOKENS
    )
    answer = llm.bind_tools(TOOLS, tool_choice="none")  # same tools: same prompt prefix

    def model(state: dict[str, Any], runtime: Any) -> Any:
        return call_tool if isinstance(state["messages"][-1], HumanMessage) else answer

    with warnings.catch_warnings():
        # LangGraph 1.x points to langchain.agents.create_agent (the `langchain` package,
        # not a dependency here); this prebuilt graph is the same ReAct loop.
        warnings.simplefilter("ignore", DeprecationWarning)
        return create_react_agent(
            model, TOOLS, prompt=system, checkpointer=checkpointer or InMemorySaver()
        )


def model_calls(messages: Sequence[BaseMessage]) -> list[AIMessage]:
    """The answers of the model (kvbranch ``response_metadata`` on each)."""
    return [m for m in messages if isinstance(m, AIMessage)]


def checkpoint_after(graph: Any, config: dict[str, Any], n_messages: int) -> Any:
    """The state snapshot of the thread's checkpoint where the conversation had
    ``n_messages`` messages and the graph had finished (the end of a turn)."""
    for snapshot in graph.get_state_history(config):
        if not snapshot.next and len(snapshot.values.get("messages", [])) == n_messages:
            return snapshot
    raise LookupError(f"no finished checkpoint with {n_messages} messages")


def show(messages: Sequence[BaseMessage]) -> None:
    for message in messages:
        if isinstance(message, AIMessage):
            meta = message.response_metadata
            print(f"  [{meta.get('branch_id', '-')}] {split_line(meta.get('kvbranch'))}")
            for call in message.tool_calls + message.invalid_tool_calls:
                print(f"      tool call {call['name']}({call['args']})")
            if message.content:
                print(f"      answer: {str(message.content).strip()[:160]}")
        elif isinstance(message, ToolMessage):
            print(f"      tool result: {message.content}")


def ask(graph: Any, config: dict[str, Any], question: str) -> list[BaseMessage]:
    """One turn from the checkpoint ``config`` names (the thread's latest without a
    ``checkpoint_id``); the messages the turn added."""
    before = len(graph.get_state(config).values.get("messages", []))
    print(f"\n== {question}")
    new = graph.invoke({"messages": [HumanMessage(question)]}, config)["messages"][before:]
    show(new)
    return new


def main() -> int:
    args = example_parser(__doc__, max_tokens=48).parse_args()
    with server_url(args.base_url, "langgraph") as base_url:
        llm = ChatKVBranch(**model_args(args, base_url))
        graph = build_agent(llm)
        thread_id = f"langgraph-{secrets.token_hex(4)}"
        thread = {"configurable": {"thread_id": thread_id}}
        ask(graph, thread, "What is the weather in Paris today?")
        after_first = len(graph.get_state(thread).values["messages"])
        ask(graph, thread, "What is the weather in Lyon today?")  # resumes the thread

        # time travel: back to the end of the first turn, and ask something else there
        snapshot = checkpoint_after(graph, thread, after_first)
        print(f"\n(time travel to checkpoint {snapshot.config['configurable']['checkpoint_id']})")
        ask(graph, snapshot.config, "What is the weather in Geneva today?")

        branches = llm.client.list_branches(thread_id)
        print(
            f"\nserver session {thread_id}: "
            + "; ".join(
                f"{b.branch_id} (parent {b.parent}, {b.num_tokens} tokens)" for b in branches
            )
        )
        llm.delete_session(config=thread)
        llm.close()
    return 0


if __name__ == "__main__":
    run(main)
