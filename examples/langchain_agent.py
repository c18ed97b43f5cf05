"""A tool-using LangChain agent on kvbranch: per turn, TTFT and where the prompt tokens came
from (device cache / host store / recomputed); at one point it forks into two alternative
plans, each on its own kvbranch branch sharing the conversation so far.

    python -m server --port 8000 &                      # a kvbranch server
    python examples/langchain_agent.py --base-url http://127.0.0.1:8000
    python examples/langchain_agent.py                  # starts (and stops) its own server

The bundled 135M model never calls tools by itself, so the tool turn forces the call
(``tool_choice`` = the tool's name). The tool is bound ``strict``: vLLM then constrains the
arguments by the tool's JSON schema (guided decoding; the city is an enum), so the call the
script runs is the one the model wrote. For a graph that does this loop for you, see
``langgraph_agent.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Literal

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage  # noqa: E402
from langchain_core.tools import tool  # noqa: E402

from examples._common import example_parser, model_args, run, server_url, split_line  # noqa: E402
from integrations.langchain import ChatKVBranch  # noqa: E402

SYSTEM = (
    "You are a travel assistant for a rail traveller. Answer in one or two short "
    "sentences. The traveller likes museums, trains, small hotels and local food, "
    "dislikes flying, and travels in late spring with a carry-on bag only. "
) * 5

WEATHER = {"Lyon": "sunny, 24 C", "Geneva": "light rain, 17 C", "Turin": "cloudy, 21 C"}

#: A forced call with its JSON envelope takes about 60 tokens with the bundled model.
TOOL_CALL_TOKENS = 96


@tool
def get_weather(city: Literal["Lyon", "Geneva", "Turin"]) -> str:
    """Get today's weather in a city."""
    return WEATHER[city]


def turn(llm: Any, history: list, label: str) -> AIMessage:
    """One streamed turn; prints TTFT and the prompt-source split."""
    full = None
    for chunk in llm.stream(history):
        full = chunk if full is None else full + chunk
    meta = full.response_metadata
    print(
        f"[{label:<16}] branch={meta.get('branch_id', '-'):<8} "
        + split_line(meta.get("kvbranch"), ttft_s=meta.get("ttft_s"))
    )
    text = (full.content or "").strip().replace("\n", " ")
    for call in full.tool_calls + full.invalid_tool_calls:
        print(f"{'':20}tool call: {call['name']}({call['args']})")
    if text:
        print(f"{'':20}{text[:100]}")
    return AIMessage(
        content=full.content,
        tool_calls=full.tool_calls,
        invalid_tool_calls=full.invalid_tool_calls,
        response_metadata=full.response_metadata,
    )


def tool_turn(llm: ChatKVBranch, history: list, city: str, label: str) -> AIMessage:
    """Ask about ``city``, force the weather tool, run the call the model wrote, and let the
    model answer; returns the tool-call message."""
    history.append(HumanMessage(f"What is the weather in {city} today?"))
    forced = llm.bind_tools(
        [get_weather], tool_choice="get_weather", strict=True, max_tokens=TOOL_CALL_TOKENS
    )
    ai = turn(forced, history, f"{label}: call")
    history.append(ai)
    for call in ai.tool_calls:  # strict: arguments that validate against the schema
        history.append(ToolMessage(get_weather.invoke(call["args"]), tool_call_id=call["id"]))
    history.append(turn(llm, history, f"{label}: answer"))
    return ai


def main() -> int:
    args = example_parser(__doc__, max_tokens=40).parse_args()
    with server_url(args.base_url, "langchain") as base_url:
        llm = ChatKVBranch(**model_args(args, base_url), auto_session=True)
        print(f"session {llm.session_id} on {base_url}")
        history: list = [
            SystemMessage(SYSTEM),
            HumanMessage("I am in Paris for a week. Suggest a day trip by train."),
        ]
        history.append(turn(llm, history, "turn 1"))
        tool_turn(llm, history, "Lyon", "turn 2")

        # fork: two alternative plans from the same point of the conversation
        plans = {"plan-a": "Geneva", "plan-b": "Turin"}
        for branch, city in plans.items():
            alt = llm.fork(branch)
            alt_history = list(history)
            alt_history.append(HumanMessage(f"Alternative: go on to {city} instead. Good idea?"))
            alt_history.append(turn(alt, alt_history, f"{branch}"))
            tool_turn(alt, alt_history, city, branch)
        llm.delete_session()
        llm.close()
    return 0


if __name__ == "__main__":
    run(main)
