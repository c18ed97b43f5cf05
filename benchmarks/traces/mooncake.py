"""Mooncake's FAST'25 conversation trace: one hour of a production chat service (Moonshot AI's
Kimi), 12,031 requests with their real arrival times, token counts and prefix block hashes.

Why this set beside BFCL: it is production serving, not a benchmark's agent — real user think
times between turns (a median of about two minutes), real prompt lengths (12k tokens on
average) and a real mix of new and returning conversations — and it is of another shape:
sessionless, no text, only which 512-token blocks a prompt shares with earlier ones. It is
shipped by a public repository (kvcache-ai/Mooncake, ``FAST25-release/traces/``, Apache-2.0);
the whole file is kept here gzipped (``data/``, 0.8 MB), so that nothing is fetched at run or
test time. Source commit and checksum: ``benchmarks/traces.md``.

How it is replayed:

* **Conversations from prefixes.** The trace has no session ids; a request whose block hashes
  start with all the full blocks of an earlier request (at least :data:`MIN_SHARED_BLOCKS` of
  them, so that a shared system prompt alone does not join two users) continues that request's
  conversation. 8,057 conversations result, 2,012 of them with two turns or more.
* **Scaled to the machine.** Each hash id becomes ``block_tokens`` token ids drawn from a
  generator seeded by the id (the same id, the same tokens: the trace's sharing is kept
  exactly); the last, partial block is scaled in proportion. The think time between two turns
  is the trace's gap times ``time_scale``; output lengths are the trace's, capped at
  ``max_tokens``. Every scale is a parameter and is printed with the results.
"""

from __future__ import annotations

import gzip
import json
import random
from dataclasses import dataclass
from pathlib import Path

from benchmarks.traces.shape import Conversation, Step

DATA = Path(__file__).resolve().parent / "data" / "mooncake_conversation_trace.jsonl.gz"
#: The trace's block size (its README: "The block size is 512 tokens").
TRACE_BLOCK_TOKENS = 512
#: Blocks a request must share with an earlier one to continue its conversation.
MIN_SHARED_BLOCKS = 2
#: Token ids drawn for the synthetic blocks: ordinary vocabulary, clear of the special tokens
#: at the start of the embedded model's vocabulary (SmolLM2: 49,152 ids).
TOKEN_RANGE = (1000, 40000)


@dataclass(frozen=True)
class Request:
    """One line of the trace (``timestamp`` in ms from the trace's start)."""

    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def read(path: Path = DATA) -> list[Request]:
    """Every request of the trace, in file (arrival) order."""
    out = []
    with gzip.open(path, "rt") as fh:
        for line in fh:
            if line.strip():
                row = json.loads(line)
                out.append(
                    Request(
                        int(row["timestamp"]),
                        int(row["input_length"]),
                        int(row["output_length"]),
                        tuple(int(h) for h in row["hash_ids"]),
                    )
                )
    return out


def chains(requests: list[Request]) -> list[list[int]]:
    """The requests' indexes grouped into conversations, each in arrival order, the
    conversations ordered by their first request (see the module docstring for the rule)."""
    owner: dict[tuple[int, ...], int] = {}
    out: list[list[int]] = []
    for i, req in enumerate(requests):
        h = req.hash_ids
        found = None
        for k in range(len(h), MIN_SHARED_BLOCKS - 1, -1):
            found = owner.get(h[:k])
            if found is not None:
                break
        if found is None:
            found = len(out)
            out.append([])
        out[found].append(i)
        full = h[:-1] if len(h) > 1 else h  # the last block is partial
        if len(full) >= MIN_SHARED_BLOCKS:
            owner[full] = found
    return out


def block_tokens(hash_id: int, n: int, seed: int = 0) -> list[int]:
    """The token ids standing for one trace block: the same for the same id and seed."""
    rng = random.Random(hash_id * 1_000_003 + seed)
    return [rng.randrange(*TOKEN_RANGE) for _ in range(n)]


def prompt_ids(req: Request, tokens_per_block: int, seed: int = 0) -> list[int]:
    """A request's prompt at ``tokens_per_block`` tokens per trace block."""
    ids: list[int] = []
    last = len(req.hash_ids) - 1
    for pos, hash_id in enumerate(req.hash_ids):
        n = tokens_per_block
        if pos == last:
            rest = req.input_length - TRACE_BLOCK_TOKENS * last
            rest = min(max(rest, 1), TRACE_BLOCK_TOKENS)
            n = max(1, round(rest * tokens_per_block / TRACE_BLOCK_TOKENS))
        ids += block_tokens(hash_id, n, seed)
    return ids


def load(
    n: int,
    max_turns: int = 4,
    skip: int = 0,
    tokens_per_block: int = 32,
    time_scale: float = 0.02,
    max_tokens: int = 8,
    max_prompt_tokens: int = 3500,
    seed: int = 0,
    path: Path = DATA,
) -> list[Conversation]:
    """The first ``n`` conversations (after ``skip``) with two turns or more whose prompts fit
    ``max_prompt_tokens`` once scaled, each cut to ``max_turns`` turns."""
    requests = read(path)
    out: list[Conversation] = []
    seen = 0
    for chain in chains(requests):
        if len(chain) < 2:
            continue
        chain = chain[:max_turns]
        prompts = [prompt_ids(requests[i], tokens_per_block, seed) for i in chain]
        if max(len(p) for p in prompts) > max_prompt_tokens:
            continue
        seen += 1
        if seen <= skip:
            continue
        steps = []
        for pos, (i, prompt) in enumerate(zip(chain, prompts, strict=True)):
            gap_ms = requests[i].timestamp_ms - requests[chain[pos - 1]].timestamp_ms if pos else 0
            steps.append(
                Step(
                    body={"prompt": prompt},
                    max_tokens=max(1, min(requests[i].output_length, max_tokens)),
                    pause_s=gap_ms / 1000.0 * time_scale,
                )
            )
        out.append(Conversation(id=f"mooncake-{chain[0]}", steps=tuple(steps)))
        if len(out) == n:
            break
    return out
