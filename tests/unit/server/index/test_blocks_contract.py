"""The block role's contract (:class:`~server.index.blocks.BlockIndex`): the longest prefix of a
chain each member holds, per tier, under its current identity and generation, on every backend
that serves the role (backends.py)."""

from __future__ import annotations

import pytest

from server.index.blocks import BlockIndex
from tests.unit.server.index.backends import LONG, MakeStore, backend_fixture, member

backend = backend_fixture(BlockIndex)


@pytest.fixture
async def store(make_store: MakeStore) -> BlockIndex:
    return await make_store()


async def test_block_hits_prefix_tier_generation(store: BlockIndex) -> None:
    p1, p2 = member("p1", gen=1), member("p2", gen=1)
    await store.publish_blocks("p1", 1, "device", [1, 2, 3, 4], [])
    await store.publish_blocks("p1", 1, "host", [1, 2], [])
    await store.publish_blocks("p2", 1, "device", [2, 3], [])  # not a prefix: no hit
    hits = await store.block_hits([1, 2, 3, 4, 5], [p1, p2])
    assert (hits["p1"].device, hits["p1"].host, hits["p1"].best) == (4, 2, 4)
    assert (hits["p2"].device, hits["p2"].host) == (0, 0)
    assert (await store.block_hits([9, 1, 2], [p1]))["p1"].best == 0
    # a member with another generation (or identity) sees none of the old entries
    assert (await store.block_hits([1, 2], [member("p1", gen=2)]))["p1"].best == 0
    assert (await store.block_hits([1, 2], [member("p9")]))["p9"].best == 0
    # a removed block ends the prefix; the host tier is another record
    await store.publish_blocks("p1", 1, "device", [], [3])
    hits = await store.block_hits([1, 2, 3, 4], [p1])
    assert (hits["p1"].device, hits["p1"].host) == (2, 2)
    # after a generation bump only the new entries count
    await store.publish_blocks("p1", 2, "device", [1], [])
    hits = await store.block_hits([1, 2], [member("p1", gen=2)])
    assert (hits["p1"].device, hits["p1"].host) == (1, 0)
    assert await store.block_hits([], [p1]) == {"p1": hits["p1"].__class__()}
    assert await store.block_hits([1, 2], []) == {}


async def test_each_tier_has_its_own_generation(store: BlockIndex) -> None:
    """A device reset bumps the device tier's generation only: the host store still has its
    blocks, so their entries stay visible; a host-store reset the other way round."""
    await store.publish_blocks("p1", 1, "device", [1, 2, 3], [])
    await store.publish_blocks("p1", 1, "host", [1, 2], [])
    device_reset = (await store.block_hits([1, 2, 3], [member("p1", gen=2, host_gen=1)]))["p1"]
    assert (device_reset.device, device_reset.host) == (0, 2)
    host_reset = (await store.block_hits([1, 2, 3], [member("p1", gen=1, host_gen=2)]))["p1"]
    assert (host_reset.device, host_reset.host) == (3, 0)
    # entries stamped after the reset count under the tier's new generation only
    await store.publish_blocks("p1", 2, "host", [1], [])
    await store.publish_blocks("p1", 1, "device", [4], [])
    hits = (await store.block_hits([1, 2, 3, 4], [member("p1", gen=1, host_gen=2)]))["p1"]
    assert (hits.device, hits.host) == (4, 1)


async def test_block_hits_long_chain(store: BlockIndex) -> None:
    n = LONG * 2 + 37
    chain = [(i * 0x9E3779B97F4A7C15) % 2**64 for i in range(1, n + 1)]
    await store.publish_blocks("p1", 1, "device", chain, [])
    await store.publish_blocks("p2", 1, "device", chain[: LONG + 5], [])
    await store.publish_blocks("p3", 1, "host", chain[:10], [])
    hits = await store.block_hits(chain, [member("p1"), member("p2"), member("p3")])
    assert hits["p1"].device == n
    assert hits["p2"].device == LONG + 5
    assert (hits["p3"].device, hits["p3"].host) == (0, 10)


async def test_block_hits_many_members(store: BlockIndex) -> None:
    """More (member, tier) pairs than one lookup script call compares."""
    fleet = [member(f"p{i}") for i in range(300)]
    await store.publish_blocks("p299", 1, "host", [5, 6], [])
    await store.publish_blocks("p0", 1, "device", [5], [])
    hits = await store.block_hits([5, 6, 7], fleet)
    assert len(hits) == 300 and (hits["p299"].host, hits["p0"].device) == (2, 1)
    assert sum(h.best for h in hits.values()) == 3
