"""A LlamaIndex FunctionAgent with tools on a kvbranch server: two agent turns in one
conversation, then a fork, printing each LLM call's TTFT and where its prompt tokens came from
(device prefix cache / kvbranch host store / recomputed).

    python -m server --port 8000 &                      # a kvbranch server
    python examples/llamaindex_agent.py --base-url http://127.0.0.1:8000

The only kvbranch-specific line is the LLM: ``KVBranchLLM`` instead of ``OpenAILike``. The
agent forces a tool call on the first step of each turn (``initial_tool_choice``): the small
bundled model answers in prose when it may choose. Needs ``llama-index-core``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

from llama_index.core.agent.workflow import (  # noqa: E402
    AgentOutput,
    FunctionAgent,
    ToolCallResult,
)
from llama_index.core.instrumentation import get_dispatcher  # noqa: E402
from llama_index.core.instrumentation.event_handlers import BaseEventHandler  # noqa: E402
from llama_index.core.instrumentation.events.llm import LLMChatEndEvent  # noqa: E402
from llama_index.core.memory import ChatMemoryBuffer  # noqa: E402

from integrations.llamaindex import KVBranchLLM  # noqa: E402
from sdk import KVBranchError  # noqa: E402

WEATHER = {"paris": "sunny, 21 C", "oslo": "light snow, -3 C", "rome": "clear, 24 C"}

# Long enough to fill whole KV blocks, so later calls can reuse them. (The bundled 135M model
# writes garbled tool arguments with some system prompts, e.g. ones that mention its tools or
# how to phrase answers: keep it plain.)
SYSTEM = ("You are a weather assistant. You answer questions about the weather in European "
          "cities such as Paris, Oslo, Rome, Lisbon, Vienna, Prague and Madrid. ") * 6


def get_weather(city: str) -> str:
    """Get the current weather in a city."""
    return WEATHER.get(str(city).strip().lower(), "cloudy, 15 C")


class CallStats(BaseEventHandler):
    """Collects the kvbranch numbers of every LLM call (LlamaIndex instrumentation)."""

    calls: list[dict[str, Any]] = []

    @classmethod
    def class_name(cls) -> str:
        return "CallStats"

    def handle(self, event: Any, **kwargs: Any) -> None:
        if isinstance(event, LLMChatEndEvent) and event.response is not None:
            self.calls.append(dict(event.response.additional_kwargs))


def call_line(info: dict[str, Any]) -> str:
    ttft = info.get("ttft_s")
    head = (f"[{info.get('branch_id') or '-'}] ttft {ttft:.2f}s" if ttft is not None
            else f"[{info.get('branch_id') or '-'}] ttft n/a")
    head += f", total {info.get('latency_s') or 0:.2f}s"
    split = info.get("kvbranch")
    if split:
        return (f"{head}, prompt {split['prompt_tokens']} tokens = device "
                f"{split['device_hit_tokens']} + host {split['host_hit_tokens']} + "
                f"recomputed {split['recomputed_tokens']}")
    return f"{head}, prompt {info.get('prompt_tokens')} tokens, cached {info.get('cached_tokens')}"


async def turn(agent: FunctionAgent, memory: ChatMemoryBuffer, stats: CallStats, label: str,
               question: str) -> None:
    print(f"\n== {label}: {question}")
    handler = agent.run(question, memory=memory)
    async for event in handler.stream_events():
        if isinstance(event, AgentOutput) and stats.calls:
            info = stats.calls.pop(0)
            calls = ", ".join(f"{c.tool_name}({c.tool_kwargs})" for c in event.tool_calls)
            print(f"  llm {call_line(info)}" + (f"  -> {calls}" if calls else ""))
        elif isinstance(event, ToolCallResult):
            print(f"  tool {event.tool_name}({event.tool_kwargs}) = {event.tool_output.content}")
    result = await handler
    print(f"  answer: {str(result.response.content or '').strip()}")


async def run(args: argparse.Namespace) -> None:
    stats = CallStats()
    get_dispatcher().add_event_handler(stats)
    llm = KVBranchLLM(base_url=args.base_url, api_key=args.api_key, model=args.model,
                      max_tokens=args.max_tokens, temperature=0)
    meta = llm.metadata
    print(f"model {meta.model_name}, context window {meta.context_window}, "
          f"session {llm.session_id}")

    agent = FunctionAgent(tools=[get_weather], llm=llm, system_prompt=SYSTEM,
                          initial_tool_choice="get_weather")
    memory = ChatMemoryBuffer.from_defaults(llm=llm)  # the second turn continues the first
    await turn(agent, memory, stats, "turn 1", "What is the weather in Paris?")
    await turn(agent, memory, stats, "turn 2", "And what is the weather in Oslo?")

    # Another line of the same conversation: a model bound to a new branch that shares the
    # cached history so far, driving its own agent with a copy of the memory.
    alt_llm = await llm.afork()
    alt_agent = FunctionAgent(tools=[get_weather], llm=alt_llm, system_prompt=SYSTEM,
                              initial_tool_choice="get_weather")
    alt_memory = ChatMemoryBuffer.from_defaults(chat_history=memory.get_all(), llm=alt_llm)
    await turn(alt_agent, alt_memory, stats, f"fork {alt_llm.branch_id}",
               "And what is the weather in Rome?")

    info = llm.session.info()
    if info is not None:
        branches = ", ".join(f"{b.branch_id}: {b.num_tokens} tokens, {b.requests} requests"
                             for b in info.branches)
        print(f"\nserver session {info.session_id}: {branches}")
    llm.delete_session()
    await llm.aclose()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default=os.environ.get("KVBRANCH_BASE_URL",
                                                             "http://127.0.0.1:8000"),
                        help="default: $KVBRANCH_BASE_URL, else http://127.0.0.1:8000")
    parser.add_argument("--api-key", default=None, help="default: $KVBRANCH_API_KEY")
    parser.add_argument("--model", default=None, help="default: the server's first model")
    parser.add_argument("--max-tokens", type=int, default=64,
                        help="per LLM call (a forced tool call needs about 50 with the "
                             "bundled model)")
    args = parser.parse_args()
    try:
        asyncio.run(run(args))
    except KVBranchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
