"""A tool-using LangChain agent on kvbranch: per turn, TTFT and where the prompt tokens came
from (device cache / host store / recomputed); at one point it forks into two alternative
plans, each on its own kvbranch branch sharing the conversation so far.

    python -m server --port 8000            # in another shell
    python examples/langchain_agent.py --base-url http://127.0.0.1:8000

The bundled 135M model never calls tools by itself, so the tool turn forces the call
(``tool_choice`` = the tool's name); the tool step is deterministic (its answer depends on the
city the script asks about, not on the model's possibly malformed arguments).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage  # noqa: E402

from integrations.langchain import ChatKVBranch  # noqa: E402
from sdk import KVBranchError  # noqa: E402

SYSTEM = ("You are a travel assistant for a rail traveller. Answer in one or two short "
          "sentences. The traveller likes museums, trains, small hotels and local food, "
          "dislikes flying, and travels in late spring with a carry-on bag only. ") * 5

WEATHER = {"Lyon": "sunny, 24 C", "Geneva": "light rain, 17 C", "Turin": "cloudy, 21 C"}


def get_weather(city: str) -> str:
    """Get today's weather for a city."""
    return WEATHER.get(city, "unknown")


def turn(llm: ChatKVBranch, history: list, label: str) -> AIMessage:
    """One streamed turn; prints TTFT and the prompt-source split."""
    full = None
    for chunk in llm.stream(history):
        full = chunk if full is None else full + chunk
    meta = full.response_metadata
    split = meta.get("kvbranch") or {}
    ttft = meta.get("ttft_s")
    print(f"[{label:<16}] branch={meta.get('branch_id', '-'):<8} "
          f"TTFT={ttft * 1000 if ttft else float('nan'):7.0f} ms  prompt={split.get('prompt_tokens', '?'):>4} "
          f"device={split.get('device_hit_tokens', '?'):>4} host={split.get('host_hit_tokens', '?'):>4} "
          f"recomputed={split.get('recomputed_tokens', '?'):>4}")
    text = (full.content or "").strip().replace("\n", " ")
    calls = full.tool_calls + full.invalid_tool_calls
    if calls:
        print(f"{'':20}tool call: {calls[0]['name']}({calls[0]['args']})")
    elif text:
        print(f"{'':20}{text[:100]}")
    return AIMessage(content=full.content, tool_calls=full.tool_calls,
                     invalid_tool_calls=full.invalid_tool_calls,
                     response_metadata=full.response_metadata)


def tool_turn(llm: ChatKVBranch, history: list, city: str, label: str) -> None:
    """Ask about ``city``, force the weather tool, run it, and let the model answer."""
    history.append(HumanMessage(f"What is the weather in {city} today?"))
    forced = llm.bind_tools([get_weather], tool_choice="get_weather")
    ai = turn(forced, history, f"{label}: call")
    call = (ai.tool_calls + ai.invalid_tool_calls)[0]
    # deterministic tool step: the city asked about, whatever the model wrote as arguments
    result = get_weather(city)
    ai = AIMessage(content="", tool_calls=[{"name": "get_weather", "args": {"city": city},
                                            "id": call.get("id") or "call_0"}])
    history += [ai, ToolMessage(result, tool_call_id=ai.tool_calls[0]["id"])]
    history.append(turn(llm, history, f"{label}: answer"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default=os.environ.get("KVBRANCH_BASE_URL",
                                                             "http://127.0.0.1:8000"),
                        help="default: $KVBRANCH_BASE_URL, else http://127.0.0.1:8000")
    parser.add_argument("--model", default=None, help="default: the server's first model")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--max-tokens", type=int, default=40)
    args = parser.parse_args()

    llm = ChatKVBranch(base_url=args.base_url, model=args.model, api_key=args.api_key,
                       temperature=0, max_tokens=args.max_tokens, auto_session=True)
    print(f"session {llm.session_id} on {args.base_url}")
    history: list = [SystemMessage(SYSTEM), HumanMessage("I am in Paris for a week. "
                                                         "Suggest a day trip by train.")]
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


if __name__ == "__main__":
    try:
        main()
    except KVBranchError as exc:  # e.g. no server there: one line, not a traceback
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(1)
