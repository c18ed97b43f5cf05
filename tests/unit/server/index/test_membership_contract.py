"""The membership role's contract (:class:`~server.index.membership.Membership`): heartbeats
register and refresh a record, a deregister or a lapsed heartbeat removes it, on every backend
that serves the role (backends.py)."""

from __future__ import annotations

import pytest

from server.index.membership import Membership
from tests.unit.server.index.backends import (
    TTL_S,
    FakeClock,
    MakeStore,
    backend_fixture,
    member,
    run_out,
)

backend = backend_fixture(Membership)


@pytest.fixture
async def store(make_store: MakeStore) -> Membership:
    return await make_store()


async def test_membership(store: Membership) -> None:
    assert await store.members() == []
    await store.heartbeat(member("p1"), 30)
    await store.heartbeat(member("d1", role="decode"), 30)
    assert sorted(await store.members(), key=lambda r: r.instance_id) == [
        member("d1", role="decode"),
        member("p1"),
    ]
    await store.heartbeat(member("p1", load=9, gen=2), 30)
    by_id = {r.instance_id: r for r in await store.members()}
    assert (by_id["p1"].load, by_id["p1"].generation) == (9, 2)
    await store.deregister("p1")
    assert [r.instance_id for r in await store.members()] == ["d1"]


async def test_membership_expires(store: Membership, backend: str, clock: FakeClock) -> None:
    await store.heartbeat(member("p1"), TTL_S)
    await store.heartbeat(member("p2"), 30)

    async def both_listed() -> bool:
        return len(await store.members()) == 2

    await run_out(backend, clock, both_listed)
    assert [r.instance_id for r in await store.members()] == ["p2"]
    await store.heartbeat(member("p1"), 30)  # back after a pause
    assert len(await store.members()) == 2
