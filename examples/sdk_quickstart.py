"""kvbranch sdk quickstart: a session with two turns (one streamed), a fork, a pin, a
prefetch and the server's stats.

    python -m server --port 8000 &                      # a kvbranch server
    python examples/sdk_quickstart.py --base-url http://127.0.0.1:8000
    python examples/sdk_quickstart.py                   # starts (and stops) its own server

Against a plain OpenAI-compatible server the same code runs client-side only (one warning).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

from examples._common import example_parser, run, sdk_client, split_line  # noqa: E402

SYSTEM = (
    "You are a concise travel assistant. Answer in one or two short sentences. "
    "You know the opening hours, prices and transport options of museums in Europe. "
) * 4


def splits(result) -> str:
    return split_line(result.split, cached_tokens=result.cached_tokens)


def main() -> int:
    args = example_parser(__doc__, max_tokens=32).parse_args()
    with sdk_client(args, "quickstart") as client:
        session = client.session(system=SYSTEM)
        main_branch = session.main
        print(f"session {session.session_id} (kvbranch: {client.kvbranch_available()})")

        first = main_branch.chat(
            "What is a good museum in Paris?", max_tokens=args.max_tokens, temperature=0
        )
        print(f"\n[main 1] {first.text}\n         {splits(first)}")

        print("\n[main 2] ", end="", flush=True)
        stream = main_branch.chat_stream(
            "How do I get there by metro?", max_tokens=args.max_tokens, temperature=0
        )
        for chunk in stream:
            print(chunk.content or "", end="", flush=True)
        result = stream.result
        print(f"\n         ttft={stream.ttft_s:.3f}s {splits(result)}")

        # Explore an alternative second turn from after the first answer.
        alt = main_branch.fork(at_message=3)
        alt.pin(ttl_s=300)
        other = alt.chat("And a good museum in Rome?", max_tokens=args.max_tokens, temperature=0)
        print(f"\n[{alt.branch_id}] {other.text}\n         {splits(other)}")

        # E.g. while a tool runs: warm the cache for the branch's next turn.
        prefetch = main_branch.prefetch()
        if prefetch is not None:
            print(f"\nprefetch main: {prefetch.status} ({prefetch.num_tokens} tokens)")
            stats = client.stats()
            print(
                f"server: {stats.requests} requests, prompt tokens by source "
                f"{stats.hits_tokens}, store {stats.store.used_blocks}/"
                f"{stats.store.capacity_blocks} blocks"
            )
        session.delete()
    return 0


if __name__ == "__main__":
    run(main)
