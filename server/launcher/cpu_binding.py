"""One OpenMP core list per data-parallel engine, from the one list a user or a scheduler gives.

vLLM's CPU worker reads ``VLLM_CPU_OMP_THREADS_BIND`` as one list per local rank, ``|``-separated,
and with ``--data-parallel-size N`` it takes the ``i``-th list for engine ``i``: a single list
(``--cpu-cores 0``, or a binding a test lane or a container runtime set) leaves engine 1 with
none, and its engine core dies at start with an assertion. The launcher therefore spreads a
single list over the engines. With at least one core per engine each engine gets an equal,
contiguous share; with fewer, every engine keeps the whole list, so that an engine computes with
as many OpenMP threads as one engine would on that list (the thread count decides how float
reductions split, so plain vLLM's greedy tokens stay the reference).
"""

from __future__ import annotations

ENV_OMP_BIND = "VLLM_CPU_OMP_THREADS_BIND"
#: vLLM's own values that name no cores.
_KEYWORDS = frozenset({"auto", "nobind"})


def parse_cores(mask: str) -> list[int]:
    """``'0-2,5'`` -> ``[0, 1, 2, 5]`` (vLLM's syntax); ValueError on anything else."""
    cores: set[int] = set()
    for part in mask.split(","):
        first, _, last = part.strip().partition("-")
        start = int(first)
        end = int(last) if last else start
        if start < 0 or end < start:
            raise ValueError(f"bad core range {part!r}")
        cores.update(range(start, end + 1))
    return sorted(cores)


def engine_binding(mask: str, engines: int) -> str:
    """``mask`` with one list per engine; unchanged where there is one engine, where ``mask``
    already has several lists (the user's own mapping) or names no cores. ValueError where a
    list cannot be read (vLLM would fail later, inside its engine core)."""
    if mask.strip() in _KEYWORDS:
        return mask
    lists = [parse_cores(part) for part in mask.split("|")]
    if engines <= 1 or len(lists) > 1:
        return mask
    cores = lists[0]
    if len(cores) < engines:
        return "|".join([mask] * engines)
    share = len(cores) // engines
    return "|".join(
        ",".join(str(core) for core in cores[i * share : (i + 1) * share]) for i in range(engines)
    )
