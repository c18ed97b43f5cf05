"""How much prefill an unbounded cross-conversation prefix cache could skip on a trace replay: the
ceiling that the capacity sweep's measured reuse is compared with (issue 39 item 4).

Why: the capacity curve on BFCL is bent by cold prefills, each conversation's first prompt of
thousands of tokens, computed in full by both servers. But conversations that use the same API
classes carry the same tools prompt, so a first prompt may share a long prefix with prompts of
*other* conversations sent before it — which a prefix cache keyed by content (vLLM's block
hashes, and kvbranch's host store, keyed by them too, not by session) could reuse. How much is a
question about the trace alone, answered here offline, without a server:

* a step's **reusable** tokens are the longest prefix of its prompt that an earlier prompt of
  the replay already covered, in whole KV blocks (:data:`KV_BLOCK`, what the server's CPU
  attention backend uses; only full blocks are cached) and never the whole prompt (the last
  token is always computed, as vLLM does);
* the cache is **unbounded**: nothing is evicted, so this is an upper bound on what any
  block-granular prefix cache could reuse in that order;
* the order is the replay's, one conversation after another (all of a conversation's steps,
  then the next): the optimistic order, since the sweep's agents start their first steps at
  once and a prompt can only hit what was computed before it was scheduled. Conversations under
  different cache salts (a copy reused past the pool) never share: :func:`ran_at` splits them.

:func:`ceiling` is pure over token-id lists; :func:`conversations_ceiling` renders
:class:`~benchmarks.traces.shape.Conversation` steps first. The command line renders the
capacity sweep's conversations with the embedded model's chat template (as the server does) and
prints the ceiling beside what each configuration of a recorded sweep reused::

    python -m benchmarks.history.prefix_ceiling --raw benchmarks/out/capacity-bfcl-<when>.json
    python -m benchmarks.history.prefix_ceiling --trace bfcl --agents 4 --per-agent 2 --max-turns 3
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.traces.shape import Conversation, Step

#: The server's KV block in tokens: vLLM's CPU attention backend's default (the launcher's
#: ``--block-size`` help; ``benchmarks.common.BLOCK_TOKENS``).
KV_BLOCK = 128


@dataclass(frozen=True)
class StepReuse:
    """One step of the replay: its prompt's tokens and how many of them the cache could reuse."""

    conv: str
    step: int
    tokens: int
    reusable: int

    @property
    def cold(self) -> bool:
        return self.step == 0


@dataclass(frozen=True)
class Totals:
    """Prompt tokens of the cold (first) and resumed steps, and how many of them were (or could
    be) reused — one shape for the ceiling and for what a configuration measured, so the two
    are read and compared the same way."""

    cold_tokens: int
    cold_reused: int
    resumed_tokens: int
    resumed_reused: int


def totals(steps: Iterable[tuple[bool, int, int]]) -> Totals:
    """:class:`Totals` of ``(cold, tokens, reused)`` per step."""
    sums = [0, 0, 0, 0]
    for cold, tokens, reused in steps:
        at = 0 if cold else 2
        sums[at] += tokens
        sums[at + 1] += reused
    return Totals(*sums)


@dataclass(frozen=True)
class Ceiling:
    """Every step's reuse, and the totals over cold (first) and resumed steps."""

    steps: tuple[StepReuse, ...]

    @property
    def totals(self) -> Totals:
        return totals((s.cold, s.tokens, s.reusable) for s in self.steps)

    def __add__(self, other: Ceiling) -> Ceiling:
        return Ceiling(self.steps + other.steps)


class _BlockTrie:
    """Every full block of every prompt seen, as a trie keyed like vLLM's block hashes (a block
    is found only under the same parent chain), exact: no hash collisions."""

    def __init__(self, block: int) -> None:
        self.block = block
        self.nodes: dict[tuple[int, tuple[int, ...]], int] = {}

    def hit(self, ids: Sequence[int]) -> int:
        """Tokens of ``ids`` covered by cached blocks, leaving at least the last token."""
        parent, n = -1, 0
        for start in range(0, (len(ids) - 1) // self.block * self.block, self.block):
            node = self.nodes.get((parent, tuple(ids[start : start + self.block])))
            if node is None:
                break
            parent, n = node, start + self.block
        return n

    def add(self, ids: Sequence[int]) -> None:
        parent = -1
        for start in range(0, len(ids) // self.block * self.block, self.block):
            key = (parent, tuple(ids[start : start + self.block]))
            parent = self.nodes.setdefault(key, len(self.nodes))


def ceiling(
    prompts: Sequence[tuple[str, Sequence[Sequence[int]]]], block: int = KV_BLOCK
) -> Ceiling:
    """The reuse of each step of ``prompts`` (``(conversation id, each step's token ids)`` in
    replay order) under one unbounded prefix cache that holds every earlier step's full blocks:
    those of earlier conversations and the same conversation's earlier steps."""
    if block < 1:
        raise ValueError("a KV block holds at least one token")
    cache = _BlockTrie(block)
    out = []
    for conv, steps in prompts:
        for pos, ids in enumerate(steps):
            out.append(StepReuse(conv, pos, len(ids), cache.hit(ids)))
            cache.add(ids)
    return Ceiling(tuple(out))


def conversations_ceiling(
    convs: Sequence[Conversation],
    render: Callable[[Step], Sequence[int]],
    block: int = KV_BLOCK,
) -> Ceiling:
    """:func:`ceiling` of ``convs``, each step rendered to its prompt's token ids by ``render``."""
    return ceiling([(c.id, [render(s) for s in c.steps]) for c in convs], block)


def chat_render(model_path: str) -> Callable[[Step], list[int]]:
    """A step's prompt ids as the server computes them: chat steps through the model's chat
    template with the generation prompt (what vLLM's chat completions renders), token-id steps
    as sent (text completions)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)

    def render(step: Step) -> list[int]:
        if not step.chat:
            return [int(t) for t in step.body["prompt"]]
        ids: Any = tokenizer.apply_chat_template(
            step.body["messages"], tokenize=True, add_generation_prompt=True
        )
        if hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
            ids = ids["input_ids"]
        return [int(t) for t in ids]

    return render


def ran_at(convs: Sequence[Conversation], agents: int, per_agent: int) -> list[list[Conversation]]:
    """The conversations the sweep ran at one agent count, one list per cache salt (copy of the
    pool), each in replay order (agent ``a``'s ``k``-th conversation is item ``a + k * agents``:
    :func:`benchmarks.capacity.sweep.assign`)."""
    from benchmarks.capacity.sweep import assign

    items = sorted(
        (k * agents + a, item)
        for a, mine in enumerate(assign(convs, agents, per_agent))
        for k, item in enumerate(mine)
    )
    copies: dict[int, list[Conversation]] = {}
    for _, (index, copy) in items:
        copies.setdefault(copy, []).append(convs[index])
    return [copies[c] for c in sorted(copies)]


def measured(turns: Sequence[dict[str, Any]]) -> Totals:
    """What one configuration reused at one agent count (prompt minus recomputed tokens): the
    totals of a recorded count's turns (the raw JSON of ``python -m benchmarks capacity``)."""
    return totals(
        (t["step"] == 0, t["prompt_tokens"], t["prompt_tokens"] - t["recomputed_tokens"])
        for t in turns
    )


def _pct(part: int, whole: int) -> str:
    return f"{part} ({100.0 * part / whole:.0f}%)" if whole else str(part)


def table(rows: Sequence[tuple[int, Totals, dict[str, Totals]]]) -> str:
    """A markdown table: per agent count the ceiling's and each configuration's reuse."""
    names = sorted({n for _, _, got in rows for n in got})
    head = ["agents", "cold tokens", "ceiling cold reusable"]
    head += [f"{n} cold reused" for n in names]
    head += ["resumed tokens", "ceiling resumed reusable"]
    head += [f"{n} resumed reused" for n in names]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for agents, ceil, got in rows:
        cells = [str(agents), str(ceil.cold_tokens), _pct(ceil.cold_reused, ceil.cold_tokens)]
        cells += [_pct(got[n].cold_reused, got[n].cold_tokens) if n in got else "" for n in names]
        cells += [str(ceil.resumed_tokens), _pct(ceil.resumed_reused, ceil.resumed_tokens)]
        cells += [
            _pct(got[n].resumed_reused, got[n].resumed_tokens) if n in got else "" for n in names
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Print the ceiling per agent count: of a recorded sweep's settings and beside its reuse
    (``--raw``), or of the capacity tool's own loader arguments."""
    from benchmarks import capacity
    from server.launcher import model_cache

    parser = argparse.ArgumentParser(prog="python -m benchmarks.history.prefix_ceiling")
    capacity.add_arguments(parser)
    parser.add_argument("--raw", type=Path, help="a capacity sweep's raw JSON (benchmarks/out)")
    parser.add_argument("--kv-block", type=int, default=KV_BLOCK, help="KV block in tokens")
    args = parser.parse_args(argv)
    kv_block = args.kv_block
    recorded: dict[int, dict[str, Totals]] = {}
    if args.raw is not None:
        raw = json.loads(args.raw.read_text())
        # the sweep's own settings, over today's defaults for options it predates
        args = argparse.Namespace(**{**vars(parser.parse_args([])), **raw["args"]})
        for name, res in raw["results"].items():
            for step in res["steps"]:
                got = measured(step["turns"])
                recorded.setdefault(step["summary"]["agents"], {})[name] = got
        counts = sorted(recorded)
    else:
        counts = capacity.agent_counts(args.agents)
    pool = max(capacity.agent_counts(args.agents)) * args.per_agent
    convs, workload = capacity.load_traces(args, pool)  # the sweep's pool: its copies
    print(f"{workload}; KV block {kv_block} tokens", file=sys.stderr)
    render = chat_render(str(model_cache.default_model_dir()))
    cache: dict[str, list[int]] = {}

    def cached(step: Step) -> list[int]:  # each step renders once over all counts
        key = json.dumps(step.body, sort_keys=True)
        if key not in cache:
            cache[key] = render(step)
        return cache[key]

    rows = []
    for n in counts:
        ceil = Ceiling(())
        for group in ran_at(convs, n, args.per_agent):
            ceil = ceil + conversations_ceiling(group, cached, kv_block)
        most = ceil.totals
        for name, got in recorded.get(n, {}).items():
            if (got.cold_tokens, got.resumed_tokens) != (most.cold_tokens, most.resumed_tokens):
                print(f"warning: {name} at {n} agents sent other prompts than rendered here")
        rows.append((n, most, recorded.get(n, {})))
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
