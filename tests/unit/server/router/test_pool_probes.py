"""Health probes never wait behind client traffic, and a crowd of callers costs one probe.

A real asyncio HTTP server on loopback stands in for an instance: it answers the health path,
and holds every other request open without answering (a tenant's slow turns). The router's
turns client is squeezed to one connection and that connection held: the probe must still
answer, because it has connections of its own.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import httpx
import pytest

from sdk.contract import HEALTH_PATH
from server.router.app import Router
from server.router.pool import Pool


class Instance:
    """A minimal HTTP/1.1 server: 200 JSON on the health path (optionally gated), never an
    answer anywhere else."""

    def __init__(self) -> None:
        self.health_requests = 0
        self.health_seen = asyncio.Event()
        self.health_open = asyncio.Event()
        self.health_open.set()
        self.held = asyncio.Event()
        self._writers: list[asyncio.StreamWriter] = []
        self._server: asyncio.Server | None = None
        self.url = ""

    async def start(self) -> Instance:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.append(writer)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                path = head.split(b" ", 2)[1].decode()
                if path != HEALTH_PATH:
                    self.held.set()
                    await asyncio.Event().wait()  # never answers
                self.health_requests += 1
                self.health_seen.set()
                await self.health_open.wait()
                body = json.dumps({"instance_id": "iid-real"}).encode()
                writer.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                    b"content-length: %d\r\n\r\n%s" % (len(body), body)
                )
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()

    async def close(self) -> None:
        for w in self._writers:
            w.close()
        if self._server is not None:
            self._server.close()


@pytest.fixture
async def instance() -> AsyncIterator[Instance]:
    inst = await Instance().start()
    yield inst
    await inst.close()


def squeezed_client() -> httpx.AsyncClient:
    """The turns' client at its limit: one connection, a short wait for it."""
    return httpx.AsyncClient(
        limits=httpx.Limits(max_connections=1),
        timeout=httpx.Timeout(30.0, pool=0.5),
    )


async def test_a_full_turns_pool_does_not_fail_the_routers_probe(instance: Instance) -> None:
    router = Router([instance.url], [instance.url], hold_ttl_s=30.0)
    own = router.pool.client
    busy = squeezed_client()
    router.pool.client = busy  # the tenant's flood: every turn connection taken
    hanging = asyncio.create_task(busy.get(instance.url + "/v1/chat/completions"))
    try:
        await instance.held.wait()
        with pytest.raises(httpx.PoolTimeout):  # the premise: the turns' pool is exhausted
            await busy.get(instance.url + "/v1/models")
        prefill = router.pool.prefills[0]
        assert await router.pool.probe(prefill, max_age=0.0)
        assert prefill.alive and prefill.instance_id == "iid-real"
        await router.pool.probe_all()
        assert all(i.alive for i in router.pool.all)
    finally:
        hanging.cancel()
        await asyncio.gather(hanging, return_exceptions=True)
        await busy.aclose()
        await own.aclose()
        await router.pool.probe_client.aclose()


async def test_callers_that_find_a_probe_in_flight_wait_for_it(instance: Instance) -> None:
    """Fifty health checks at once against a stale instance: one probe reaches it."""
    client = httpx.AsyncClient()
    pool = Pool([instance.url], [instance.url], client=client)
    instance.health_open.clear()
    prefill = pool.prefills[0]
    try:
        callers = [asyncio.create_task(pool.probe(prefill, max_age=0.0)) for _ in range(50)]
        await instance.health_seen.wait()
        instance.health_open.set()
        assert await asyncio.gather(*callers) == [True] * 50
        assert instance.health_requests == 1
        # and the health route's probe_all within PROBE_MAX_AGE_S asks nobody again
        for _ in range(20):
            await pool.probe_all()
        assert instance.health_requests == 2  # the decode instance's first probe only
    finally:
        await client.aclose()


async def test_health_probes_an_instance_last_seen_down_again(instance: Instance) -> None:
    """A background probe saw the decode instance down a moment ago and it is back now: the
    health route's probe_all asks it again instead of reporting the cached 'down'."""
    client = httpx.AsyncClient()
    pool = Pool([instance.url], [instance.url], client=client)
    try:
        await pool.probe_all()
        before = instance.health_requests
        decode = pool.decodes[0]
        pool.mark_down(decode)  # what the probe that raced the restart recorded
        await pool.probe_all()
        assert decode.alive
        assert instance.health_requests == before + 1  # the live prefill instance: cached
    finally:
        await client.aclose()
