"""What every role's contract suite shares: the backends, how a suite picks the ones serving its
role, and the records and clock the suites build.

Each role of the index (:mod:`server.index.sessions`, :mod:`server.index.membership`,
:mod:`server.index.blocks`) has its own suite, ``test_<role>_contract.py``, run on every backend
that implements the role: the embedded one, the Redis one on a real redis-server
(tests/redis_server.py) and the Redis one behind the circuit breaker, as ``open_store`` makes it
for production (so each forwarding method is checked). Each Redis test gets its own
``cluster`` name, so no two tests share a key. What only the Redis backend can be asked (TTLs
on every key, tampered values, schema, outages, round trips) is in test_redis_store.py.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from server.index import Hold, InstanceRecord, Key
from server.index.base import IndexBackend
from server.index.guarded import GuardedStore
from server.index.memory import MemoryIndexStore
from server.index.redis_store import RedisIndexStore
from server.index.store import IndexStore
from tests.unit.waiting import HANG_GUARD_S

#: Every backend by the name its tests carry, with the class that says which roles it serves.
BACKENDS: dict[str, type[IndexBackend]] = {
    "memory": MemoryIndexStore,
    "redis": RedisIndexStore,
    "guarded": GuardedStore,
}

names = itertools.count()
#: A chain length well past anything a small pipeline or script loop special-cases.
LONG = 128
KEY: Key = ("tenant-a", "sess:1", "main")
MakeStore = Callable[..., Awaitable[IndexStore]]
#: A TTL the expiry tests let run out. The embedded index runs on the test's clock (moved, never
#: slept on); Redis keeps TTLs on its own clock, so there the test waits for the state, and this
#: leaves the check made before it runs out a second of margin on a loaded machine.
TTL_S = 1.0
#: Just under a TTL (exact in binary, so ``start + TTL_S - JUST`` is below ``start + TTL_S``).
JUST = 2**-10


def serving(role: type[IndexBackend]) -> list[str]:
    """The backends that implement ``role``."""
    return [name for name, cls in BACKENDS.items() if issubclass(cls, role)]


def backend_fixture(role: type[IndexBackend]) -> Any:
    """A suite's ``backend`` fixture: each of its tests runs once per backend serving ``role``
    (a test that names its backends with ``parametrize`` overrides it)."""

    @pytest.fixture(params=serving(role))
    def backend(request: pytest.FixtureRequest) -> str:
        return str(request.param)

    return backend


class FakeClock:
    """The embedded index's clock in these tests: it moves only when the test moves it."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def hold(turn: int, *, url: str = "http://d1", hashes: list[str] | None = None) -> Hold:
    params = {"remote_num_tokens": 32, "token_ids": list(range(40)), "turn": turn}
    if hashes is not None:
        params["kvbranch_block_hashes"] = hashes
    return Hold(url, "d1-id", params, turn=turn)


def member(
    iid: str,
    *,
    gen: int = 1,
    host_gen: int | None = None,
    role: str = "prefill",
    load: int = 0,
) -> InstanceRecord:
    """A member whose device tier is at generation ``gen`` and host tier at ``host_gen``
    (``gen`` unless given)."""
    return InstanceRecord(
        instance_id=iid,
        url=f"http://{iid}",
        role=role,  # type: ignore[arg-type]
        model="m",
        block_size=16,
        nixl="127.0.0.1:5600",
        generation=gen,
        host_generation=gen if host_gen is None else host_gen,
        load=load,
        kv_usage=0.25,
        engines=2,
        started_at=1700000000.125,
    )


async def run_out(
    backend: str, clock: FakeClock, still_there: Callable[[], Awaitable[bool]]
) -> None:
    """Let a TTL of ``TTL_S`` that started at ``clock.now`` run out: the embedded index's
    clock is moved to just before it (``still_there`` must hold) and then to it; with Redis,
    ``still_there`` must hold now and stop holding within a hang guard."""
    start = clock.now
    if backend == "memory":
        clock.now = start + TTL_S - JUST
        assert await still_there(), "expired before its TTL"
        clock.now = start + TTL_S
        assert not await still_there(), "still there when its TTL ran out"
        return
    assert await still_there(), "expired before its TTL"
    deadline = time.monotonic() + TTL_S + HANG_GUARD_S
    while await still_there():
        assert time.monotonic() < deadline, "never expired"
        await asyncio.sleep(0.05)
