"""The README's main job: start the kvbranch server on the embedded model, run a short agent
session against it (streamed answers, a tool observation, a fork), print the answers, the time
to first token and where each prompt's tokens came from, then stop the server.

    .venv/bin/python examples/demo.py                      # starts and stops its own server
    .venv/bin/python examples/demo.py --base-url http://127.0.0.1:8000   # use a running one
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from contextlib import ExitStack
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

from sdk import KVBranchClient, KVBranchError  # noqa: E402
from server.process import ServerProcess, free_port  # noqa: E402

SYSTEM = (
    "You are a travel agent's assistant. Answer briefly and factually. You can look things up "
    "with tools; their results arrive as observations. "
    + " ".join(f"Policy {i}: quote prices in euros and name the source of each fact."
               for i in range(1, 25))
)


def describe(result) -> str:
    s = result.split
    ttft = f"TTFT {result.ttft_s:.2f}s" if result.ttft_s is not None else ""
    if s is None:
        return f"        cached {result.cached_tokens} tokens   {ttft}"
    return (f"        prompt {s.prompt_tokens} tokens: device {s.device_hit_tokens}, "
            f"host {s.host_hit_tokens}, recomputed {s.recomputed_tokens}   {ttft}")


def turn(branch, label: str, text: str, max_tokens: int):
    print(f"{label:<7} {text}")
    stream = branch.chat_stream(text, max_tokens=max_tokens, temperature=0)
    print("        -> ", end="", flush=True)
    for chunk in stream:
        print(chunk.content or "", end="", flush=True)
    print()
    result = stream.result
    print(describe(result))
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default=os.environ.get("KVBRANCH_BASE_URL"),
                        help="use this running server instead of starting one "
                             "(default: $KVBRANCH_BASE_URL when set)")
    parser.add_argument("--max-tokens", type=int, default=24)
    args = parser.parse_args()

    with ExitStack() as stack:
        base_url = args.base_url
        if base_url is None:
            port = free_port()
            print(f"[demo] starting the kvbranch server on http://127.0.0.1:{port} ...",
                  end="", flush=True)
            started = time.monotonic()
            server = stack.enter_context(ServerProcess(["--kv-cache-gib", "0.5"],
                                                       name="demo", port=port))
            print(f" ready in {time.monotonic() - started:.0f}s (log: {server.log_path})")
            base_url = server.url
        try:
            client = stack.enter_context(KVBranchClient(base_url))
            session = client.session(system=SYSTEM)
            main_branch = session.main
            turn(main_branch, "turn 1", "What is the capital of France?", args.max_tokens)
            main_branch.add({"role": "user", "content":
                             "Observation from tool hotel_search(city='Paris'): Hotel Lumiere, "
                             "4 stars, 180 EUR per night, 2 rooms left; Hotel Seine, 3 stars, "
                             "120 EUR per night, 5 rooms left."})
            main_branch.prefetch()  # while the "tool" ran: warm the cache for the next turn
            turn(main_branch, "turn 2", "Which hotel is cheaper?", args.max_tokens)
            alt = main_branch.fork(at_message=3)  # an alternative plan after the first answer
            turn(alt, "fork", "Suggest a museum to visit instead.", args.max_tokens)
            stats = client.stats()
            if stats is not None:
                print(f"[demo] server: prompt tokens by source {stats.hits_tokens}; host store "
                      f"{stats.store.used_blocks}/{stats.store.capacity_blocks} blocks")
            session.delete()
        except KVBranchError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
