"""kvbranch sdk quickstart: a session with two turns (one streamed), a fork, a pin, a
prefetch and the server's stats. Starts nothing: point it at a running server.

    python -m server --port 8000 &                      # a kvbranch server
    python examples/sdk_quickstart.py --base-url http://127.0.0.1:8000

Against a plain OpenAI-compatible server the same code runs client-side only (one warning).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

from sdk import KVBranchClient, KVBranchError  # noqa: E402

SYSTEM = ("You are a concise travel assistant. Answer in one or two short sentences. "
          "You know the opening hours, prices and transport options of museums in Europe. ") * 4


def split_line(result) -> str:
    s = result.split
    if s is None:
        return f"cached_tokens={result.cached_tokens}"
    return (f"prompt={s.prompt_tokens} device={s.device_hit_tokens} host={s.host_hit_tokens} "
            f"recomputed={s.recomputed_tokens}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default=os.environ.get("KVBRANCH_BASE_URL",
                                                             "http://127.0.0.1:8000"),
                        help="default: $KVBRANCH_BASE_URL, else http://127.0.0.1:8000")
    parser.add_argument("--api-key", default=None, help="default: $KVBRANCH_API_KEY")
    parser.add_argument("--model", default=None, help="default: the server's first model")
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()

    try:
        with KVBranchClient(args.base_url, api_key=args.api_key, model=args.model) as client:
            session = client.session(system=SYSTEM)
            main_branch = session.main
            print(f"session {session.session_id} (kvbranch: {client.kvbranch_available()})")

            first = main_branch.chat("What is a good museum in Paris?",
                                     max_tokens=args.max_tokens, temperature=0)
            print(f"\n[main 1] {first.text}\n         {split_line(first)}")

            print("\n[main 2] ", end="", flush=True)
            stream = main_branch.chat_stream("How do I get there by metro?",
                                             max_tokens=args.max_tokens, temperature=0)
            for chunk in stream:
                print(chunk.content or "", end="", flush=True)
            result = stream.result
            print(f"\n         ttft={stream.ttft_s:.3f}s {split_line(result)}")

            # Explore an alternative second turn from after the first answer.
            alt = main_branch.fork(at_message=3)
            alt.pin(ttl_s=300)
            other = alt.chat("And a good museum in Rome?", max_tokens=args.max_tokens,
                             temperature=0)
            print(f"\n[{alt.branch_id}] {other.text}\n         {split_line(other)}")

            # E.g. while a tool runs: warm the cache for the branch's next turn.
            prefetch = main_branch.prefetch()
            if prefetch is not None:
                print(f"\nprefetch main: {prefetch.status} ({prefetch.num_tokens} tokens)")
                stats = client.stats()
                print(f"server: {stats.requests} requests, prompt tokens by source "
                      f"{stats.hits_tokens}, store {stats.store.used_blocks}/"
                      f"{stats.store.capacity_blocks} blocks")
            session.delete()
    except KVBranchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
