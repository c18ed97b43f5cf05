"""benchmarks/moved_turn: a probe's second turns, moved and local, are sent at spread points
of the replicas' engine steps, never a fixed time after the load resumes (where the step's
phase alone decided the ratio). Pure logic: the turns and the clock are fakes."""

from __future__ import annotations

import argparse
import asyncio
import types
from typing import Any

from benchmarks import moved_turn


def _probe_waits(monkeypatch, probes: int) -> list[dict[str, float]]:
    """For each probe: the wait right before each kind's second turn."""
    waits: list[float] = []
    sent: list[tuple[str, float]] = []

    async def sleep(seconds: float) -> None:
        waits.append(seconds)

    async def turn(client: Any, url: str, messages: list, session: str) -> Any:
        kind = session.split("-")[1]
        if len(messages) > 2:  # the second turn: what was waited just before it
            sent.append((kind, waits[-1]))
        return types.SimpleNamespace(
            content="ok",
            ttft_s=0.1,
            prompt_tokens=10,
            remote_hit_tokens=0,
            host_hit_tokens=0,
            device_hit_tokens=0,
            recomputed_tokens=10,
        )

    async def reset(client: Any, url: str) -> None:
        return None

    monkeypatch.setattr(moved_turn.asyncio, "sleep", sleep)
    monkeypatch.setattr(moved_turn, "_turn", turn)
    monkeypatch.setattr(moved_turn, "_reset_device", reset)
    args = argparse.Namespace(probe_tokens=40)
    load = moved_turn.Load()

    async def run() -> None:
        for k in range(probes):
            await moved_turn._probe(None, ["http://a", "http://b"], k, args, load)  # type: ignore[arg-type]

    asyncio.run(run())
    out: list[dict[str, float]] = [{} for _ in range(probes)]
    for i, (kind, wait) in enumerate(sent):
        out[i // 2][kind] = wait
    return out


def test_every_second_turn_waits_a_spread_draw_first(monkeypatch) -> None:
    probes = _probe_waits(monkeypatch, 8)
    waits = [w for p in probes for w in (p["moved"], p["local"])]
    assert all(0.0 <= w <= moved_turn.ARRIVAL_SPREAD_S for w in waits)
    # Spread over the window for both kinds, not one fixed phase.
    for kind in ("moved", "local"):
        drawn = [p[kind] for p in probes]
        assert len(set(drawn)) == len(drawn)
        assert max(drawn) - min(drawn) > moved_turn.ARRIVAL_SPREAD_S / 3


def test_a_probes_draws_repeat_from_run_to_run(monkeypatch) -> None:
    assert _probe_waits(monkeypatch, 3) == _probe_waits(monkeypatch, 3)
