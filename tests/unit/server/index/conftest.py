"""The role contract suites' fixtures (tests/unit/server/index/backends.py says how they fit):
each suite names its ``backend`` fixture; these build its stores."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import pytest

from server.index.guarded import GuardedStore
from server.index.memory import MemoryIndexStore
from server.index.redis_store import RedisIndexStore
from server.index.store import IndexStore
from tests.redis_server import RedisServer
from tests.unit.server.index.backends import FakeClock, MakeStore, names


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
async def make_store(
    backend: str, clock: FakeClock, request: pytest.FixtureRequest
) -> AsyncIterator[MakeStore]:
    """Stores of one index: for Redis each call is another router (its own connections) on
    this test's cluster name; the embedded index lives in one process, so its "routers" share
    the one object."""
    cluster = f"t{next(names)}-{int(time.time() * 1000) % 10**8}"
    made: list[IndexStore] = []
    memory: dict[float, MemoryIndexStore] = {}

    async def make(hold_ttl_s: float = 30.0, **kwargs: float) -> IndexStore:
        if backend == "memory":
            if hold_ttl_s not in memory:
                memory[hold_ttl_s] = MemoryIndexStore(hold_ttl_s, clock=clock, **kwargs)  # type: ignore[arg-type]
            return memory[hold_ttl_s]
        server: RedisServer = request.getfixturevalue("redis_server")
        redis = RedisIndexStore.from_url(
            server.url, hold_ttl_s=hold_ttl_s, cluster=cluster, **kwargs
        )
        store: IndexStore = GuardedStore(redis) if backend == "guarded" else redis
        await store.ping()
        made.append(store)
        return store

    yield make
    for store in made:
        await store.close()
