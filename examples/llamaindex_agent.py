"""LlamaIndex agents on a kvbranch server: a ``ReActAgent`` (tool use in prose) and a
``FunctionAgent`` (OpenAI tool calls), each for two turns with memory, then a fork of the
FunctionAgent's conversation; every LLM call prints its branch and where its prompt tokens came
from (device prefix cache / kvbranch host store / recomputed).

    python -m server --port 8000 &                      # a kvbranch server
    python examples/llamaindex_agent.py --base-url http://127.0.0.1:8000
    python examples/llamaindex_agent.py                 # starts (and stops) its own server

The only kvbranch-specific line is the LLM: ``KVBranchLLM`` instead of ``OpenAILike``. The
bundled 135M model needs its tool calls guided to write sane arguments:

* ``ReActAgent``: every LLM answer is one ReAct step constrained by a regular expression
  (vLLM guided decoding, ``structured_outputs.regex``): before an observation it must be an
  ``Action`` of a known tool whose ``Action Input`` follows the tool's JSON schema (an enum of
  the cities it knows), after one an ``Answer``;
* ``FunctionAgent``: the tool is ``strict`` (vLLM then constrains the arguments by its JSON
  schema) and the first step of each turn must call it (``initial_tool_choice``).

Needs ``llama-index-core`` (the ``llamaindex`` extra).
"""

# No ``from __future__ import annotations``: LlamaIndex reads the tool's signature at run time.
import asyncio
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

from llama_index.core.agent.workflow import (  # noqa: E402
    AgentOutput,
    FunctionAgent,
    ReActAgent,
    ToolCallResult,
)
from llama_index.core.agent.workflow.base_agent import BaseWorkflowAgent  # noqa: E402
from llama_index.core.base.llms.types import ChatMessage, MessageRole  # noqa: E402
from llama_index.core.memory import Memory  # noqa: E402
from llama_index.core.tools import FunctionTool, ToolMetadata  # noqa: E402

from examples._common import (  # noqa: E402
    REACT_ANSWER_REGEX,
    example_parser,
    model_args,
    react_action_regex,
    run,
    server_url,
    split_line,
)
from integrations.llamaindex import KVBranchLLM  # noqa: E402

WEATHER = {"Paris": "sunny, 21 C", "Oslo": "light snow, -3 C", "Rome": "clear, 24 C"}

# Long enough to fill whole KV blocks, so later calls can reuse them. (The bundled 135M model
# writes worse answers with system prompts that mention its tools: keep it plain.)
SYSTEM = (
    "You are a weather assistant. You answer questions about the weather in European "
    "cities such as Paris, Oslo, Rome, Lisbon, Vienna, Prague and Madrid. "
) * 6


def get_weather(city: Literal["Paris", "Oslo", "Rome"]) -> str:
    """Get the current weather in a city."""
    return WEATHER[city]


class StrictToolMetadata(ToolMetadata):
    """Tool metadata whose OpenAI spec says ``strict``: vLLM then constrains the call's
    arguments by the parameters' JSON schema (without it, only the call's envelope)."""

    def to_openai_tool(self, skip_length_check: bool = False) -> dict[str, Any]:
        spec = super().to_openai_tool(skip_length_check=skip_length_check)
        spec["function"]["strict"] = True
        return spec


def strict_tool(fn: Callable[..., Any]) -> FunctionTool:
    plain = FunctionTool.from_defaults(fn)
    meta = plain.metadata
    return FunctionTool.from_defaults(
        fn,
        tool_metadata=StrictToolMetadata(
            name=meta.name, description=meta.description, fn_schema=meta.fn_schema
        ),
    )


def tool_parameters(tools: Sequence[FunctionTool]) -> dict[str, dict[str, Any]]:
    """Tool name → JSON schema of its parameters."""
    return {t.metadata.name or "": t.metadata.get_parameters_dict() for t in tools}


class ReActGuidedLLM(KVBranchLLM):
    """A ``KVBranchLLM`` whose every answer is one ReAct step, by guided decoding: an action
    of one of ``react_tools`` with schema-valid arguments before an observation, an answer
    after it. (LlamaIndex's ``ReActAgent`` passes no per-call parameters to its LLM, so the
    choice is made here, from the messages.)"""

    react_tools: dict[str, dict[str, Any]] = {}

    def _guided(self, messages: Sequence[ChatMessage], kwargs: dict[str, Any]) -> dict[str, Any]:
        last = messages[-1] if messages else None
        observed = (
            last is not None
            and last.role == MessageRole.USER
            and str(last.content or "").startswith("Observation:")
        )
        regex = REACT_ANSWER_REGEX if observed else react_action_regex(self.react_tools)
        body = {**(kwargs.pop("extra_body", None) or {}), "structured_outputs": {"regex": regex}}
        return {**kwargs, "extra_body": body}

    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> Any:
        return super().chat(messages, **self._guided(messages, kwargs))

    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> Any:
        return super().stream_chat(messages, **self._guided(messages, kwargs))

    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> Any:
        return await super().achat(messages, **self._guided(messages, kwargs))

    async def astream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> Any:
        return await super().astream_chat(messages, **self._guided(messages, kwargs))


@dataclass
class Turn:
    """What one agent run did: the answer, the server's prompt-source split of each LLM call
    (from the raw response) and the tool calls."""

    answer: str
    splits: list[dict[str, Any]] = field(default_factory=list)
    tool_calls: list[ToolCallResult] = field(default_factory=list)


async def turn(agent: BaseWorkflowAgent, memory: Memory, question: str) -> Turn:
    """One agent run on ``memory``, printing each LLM call and tool call."""
    print(f"\n== {question}")
    handler = agent.run(question, memory=memory)
    done = Turn(answer="")
    async for event in handler.stream_events():
        if isinstance(event, AgentOutput):
            raw = event.raw if isinstance(event.raw, dict) else {}
            split = raw.get("kvbranch") or {}
            done.splits.append(split)
            print(f"  llm [{split.get('branch_id', '-')}] {split_line(split)}")
        elif isinstance(event, ToolCallResult):
            done.tool_calls.append(event)
            print(
                f"      tool {event.tool_name}({event.tool_kwargs}) = {event.tool_output.content}"
            )
    done.answer = str((await handler).response.content or "").strip()
    print(f"      answer: {done.answer[:160]}")
    return done


def react_agent(
    llm: KVBranchLLM, tools: Sequence[FunctionTool], system: str = SYSTEM
) -> ReActAgent:
    return ReActAgent(tools=list(tools), llm=llm, system_prompt=system, streaming=False)


def function_agent(
    llm: KVBranchLLM, tools: Sequence[FunctionTool], system: str = SYSTEM
) -> FunctionAgent:
    """Forces the first tool on the first step of each run (``initial_tool_choice``)."""
    return FunctionAgent(
        tools=list(tools), llm=llm, system_prompt=system, initial_tool_choice=tools[0].metadata.name
    )


async def run_agents(base_url: str, args: Any) -> None:
    common = model_args(args, base_url)
    tools = [strict_tool(get_weather)]

    print("--- ReActAgent")
    react_llm = ReActGuidedLLM(react_tools=tool_parameters(tools), **common)
    agent: BaseWorkflowAgent = react_agent(react_llm, tools)
    memory = Memory.from_defaults(session_id="react", token_limit=3000)
    await turn(agent, memory, "What is the weather in Paris?")
    await turn(agent, memory, "What is the weather in Oslo?")  # memory: turn 1
    react_llm.delete_session()
    await react_llm.aclose()

    print("\n--- FunctionAgent")
    llm = KVBranchLLM(**common)
    agent = function_agent(llm, tools)
    memory = Memory.from_defaults(session_id="function", token_limit=3000)
    await turn(agent, memory, "What is the weather in Paris?")
    await turn(agent, memory, "What is the weather in Oslo?")

    # Another line of the same conversation: a model bound to a new branch that shares the
    # cached history so far, driving its own agent with a copy of the memory.
    alt_llm = await llm.afork()
    alt_memory = Memory.from_defaults(session_id="function-alt", token_limit=3000)
    await alt_memory.aput_messages(await memory.aget_all())
    print(f"\n(fork: branch {alt_llm.branch_id})")
    await turn(function_agent(alt_llm, tools), alt_memory, "What is the weather in Rome?")

    info = llm.session.info()
    if info is not None:
        print(
            f"\nserver session {info.session_id}: "
            + "; ".join(
                f"{b.branch_id}: {b.num_tokens} tokens, {b.requests} requests"
                for b in info.branches
            )
        )
    llm.delete_session()
    await llm.aclose()


def main() -> int:
    args = example_parser(__doc__, max_tokens=96).parse_args()
    with server_url(args.base_url, "llamaindex") as base_url:
        asyncio.run(run_agents(base_url, args))
    return 0


if __name__ == "__main__":
    run(main)
