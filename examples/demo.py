"""The README's main job: start the kvbranch server on the embedded model, run a short agent
session against it (streamed answers, a tool observation, a fork), print the answers, the time
to first token and where each prompt's tokens came from, then stop the server.

    .venv/bin/python examples/demo.py                      # starts and stops its own server
    .venv/bin/python examples/demo.py --base-url http://127.0.0.1:8000   # use a running one
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

from examples._common import example_parser, run, sdk_client, split_line  # noqa: E402

SYSTEM = (
    "You are a travel agent's assistant. Answer briefly and factually. You can look things up "
    "with tools; their results arrive as observations. "
    + " ".join(
        f"Policy {i}: quote prices in euros and name the source of each fact." for i in range(1, 25)
    )
)


def turn(branch, label: str, text: str, max_tokens: int):
    print(f"{label:<7} {text}")
    stream = branch.chat_stream(text, max_tokens=max_tokens, temperature=0)
    print("        -> ", end="", flush=True)
    for chunk in stream:
        print(chunk.content or "", end="", flush=True)
    print()
    result = stream.result
    print(
        "        "
        + split_line(result.split, cached_tokens=result.cached_tokens, ttft_s=result.ttft_s)
    )
    return result


def main() -> int:
    args = example_parser(__doc__, max_tokens=24).parse_args()
    with sdk_client(args, "demo") as client:
        session = client.session(system=SYSTEM)
        main_branch = session.main
        turn(main_branch, "turn 1", "What is the capital of France?", args.max_tokens)
        main_branch.add(
            {
                "role": "user",
                "content": "Observation from tool hotel_search(city='Paris'): Hotel Lumiere, "
                "4 stars, 180 EUR per night, 2 rooms left; Hotel Seine, 3 stars, "
                "120 EUR per night, 5 rooms left.",
            }
        )
        main_branch.prefetch()  # while the "tool" ran: warm the cache for the next turn
        turn(main_branch, "turn 2", "Which hotel is cheaper?", args.max_tokens)
        alt = main_branch.fork(at_message=3)  # an alternative plan after the first answer
        turn(alt, "fork", "Suggest a museum to visit instead.", args.max_tokens)
        stats = client.stats()
        if stats is not None:
            print(
                f"[demo] server: prompt tokens by source {stats.hits_tokens}; host store "
                f"{stats.store.used_blocks}/{stats.store.capacity_blocks} blocks"
            )
        session.delete()
    return 0


if __name__ == "__main__":
    run(main)
