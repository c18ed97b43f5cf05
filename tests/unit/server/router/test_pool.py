"""The instance pool: session affinity that survives an instance leaving and coming back
(rendezvous hashing), and ejection of an instance that keeps failing requests while its
health check still answers."""

from __future__ import annotations

import asyncio
import collections

import httpx

from server.router import pool as pool_mod
from server.router.pool import Pool
from tests.unit.server.router.fakes import D, base_of, json_reply

PS = [f"http://p{i}.test:1" for i in range(3)]


class FakeClock:
    """The pool's router clock, moved by the test: ages and deadlines without sleeping."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _pool(down: set[str], clock: FakeClock | None = None) -> Pool:
    def handler(request: httpx.Request) -> httpx.Response:
        if base_of(request) in down:
            raise httpx.ConnectError("refused", request=request)
        return json_reply(200, {"instance_id": base_of(request)})

    client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    return Pool(PS, [D], client=client, clock=clock or FakeClock())


def _placement(pool: Pool, sessions: list[str]) -> dict[str, str]:
    async def go() -> dict[str, str]:
        out = {}
        for s in sessions:
            inst = await pool.choose_prefill(("t", s, "main"))
            assert inst is not None
            out[s] = inst.url
        return out

    return asyncio.run(go())


def test_sessions_spread_over_prefills_and_stay_put_when_another_one_leaves_and_returns():
    sessions = [f"s{i}" for i in range(300)]
    down: set[str] = set()
    pool = _pool(down)
    before = _placement(pool, sessions)
    counts = collections.Counter(before.values())
    assert set(counts) == set(PS) and min(counts.values()) >= 60, counts

    down.add(PS[1])
    for inst in pool.prefills:
        inst.checked_at = 0.0  # probe again now
    during = _placement(pool, sessions)
    moved = [s for s in sessions if during[s] != before[s]]
    assert all(before[s] == PS[1] for s in moved), "a session on a live prefill moved"
    assert {during[s] for s in moved} == {PS[0], PS[2]}, "the left instance's sessions spread"

    down.clear()
    for inst in pool.prefills:
        inst.checked_at = 0.0
    assert _placement(pool, sessions) == before, "sessions did not return to their prefill"


def test_an_instance_failing_requests_is_ejected_then_tried_again():
    clock = FakeClock()
    pool = _pool(set(), clock)
    p0 = pool.prefills[0]

    async def live() -> list[str]:
        return [i.url for i in await pool.live(pool.prefills)]

    assert PS[0] in asyncio.run(live())
    for _ in range(pool_mod.EJECT_AFTER_FAILURES - 1):
        pool.failed(p0)
    assert PS[0] in asyncio.run(live()), "ejected before the threshold"
    pool.failed(p0)
    p0.checked_at = 0.0  # its health check answers 200: ejection wins over it
    assert PS[0] not in asyncio.run(live())
    assert not p0.info()["alive"] and p0.info()["failures"] == pool_mod.EJECT_AFTER_FAILURES
    clock.now += pool_mod.EJECT_S - 0.01
    p0.checked_at = 0.0
    assert PS[0] not in asyncio.run(live()), "tried again before the ejection ended"
    clock.now += 0.01
    assert PS[0] in asyncio.run(live()), "not tried again after the ejection"
    pool.failed(p0)  # still failing: out again at once
    assert PS[0] not in asyncio.run(live())
    p0.ejected_until = 0.0
    p0.checked_at = 0.0
    pool.succeeded(p0)
    for _ in range(pool_mod.EJECT_AFTER_FAILURES - 1):
        pool.failed(p0)
    assert PS[0] in asyncio.run(live()), "a success did not reset the count"


def test_an_instance_without_kvbranchs_health_route_is_named_once_in_the_log(caplog):
    """Plain vLLM behind the router answers 404 on the health route: the router never sends it
    a turn, and says why once, not with every probe."""

    def handler(request: httpx.Request) -> httpx.Response:
        return json_reply(404, {"detail": "Not Found"})

    client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    pool = Pool(PS[:1], [D], client=client, clock=FakeClock())
    inst = pool.prefills[0]

    async def probe_twice() -> list[bool]:
        first = await pool.probe(inst, max_age=0.0)
        inst.checked_at = 0.0
        return [first, await pool.probe(inst, max_age=0.0)]

    with caplog.at_level("WARNING", logger="kvbranch.router"):
        assert asyncio.run(probe_twice()) == [False, False]
    said = [r.getMessage() for r in caplog.records if "not a kvbranch instance" in r.getMessage()]
    assert len(said) == 1 and PS[0] in said[0]
