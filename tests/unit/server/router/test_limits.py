"""server.router.limits on a real uvicorn server on loopback: idle sockets give way to clients
that send requests (2,100 idle sockets used to make every real request a 503), and a
connection that never sends its headers is closed."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import uvicorn
from fastapi import FastAPI

from server.launcher.process import free_port
from server.launcher.settings import build_parser
from server.router.launch import router_protocol

#: The header deadline these tests give the router's flag: seconds, not the default 30 s.
HEADER_DEADLINE_S = 2.0
#: The router's protocol as its flag configures it, with small connection bounds.
SmallBounds = router_protocol(
    build_parser().parse_args(["--header-timeout-s", str(HEADER_DEADLINE_S)])
)
SmallBounds.max_connections = 40
SmallBounds.max_peer_connections = 30


@pytest.fixture
def server() -> Iterator[str]:
    app = FastAPI()

    @app.get("/ping")
    async def ping() -> dict[str, str]:
        return {"pong": "yes"}

    port = free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, http=SmallBounds, log_level="error")
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not srv.started:
        assert time.monotonic() < deadline, "server did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    srv.should_exit = True
    thread.join(10)


def _idle_sockets(url: str, n: int) -> list[socket.socket]:
    host, port = url.rsplit("//", 1)[1].split(":")
    return [socket.create_connection((host, int(port))) for _ in range(n)]


def _closed(sock: socket.socket) -> bool:
    sock.setblocking(False)
    try:
        return sock.recv(1) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def test_many_idle_sockets_leave_a_real_request_served(server):
    idle = _idle_sockets(server, 100)  # 2.5x the bound, from the client's own address
    try:
        time.sleep(0.2)  # the server has accepted them (and closed the oldest as they came)
        r = httpx.get(server + "/ping", timeout=10)
        assert r.status_code == 200 and r.json() == {"pong": "yes"}
        assert sum(_closed(s) for s in idle) >= 100 - SmallBounds.max_peer_connections
    finally:
        for s in idle:
            s.close()


def test_a_connection_that_sends_no_headers_is_closed(server):
    (sock,) = _idle_sockets(server, 1)
    # The deadline given, not the protocol's own: a router that ignores its flag (30 s) fails.
    sock.settimeout(HEADER_DEADLINE_S * 5)
    try:
        assert sock.recv(1) == b""  # closed by the server (a hang here fails by the timeout)
    finally:
        sock.close()


def test_busy_connections_are_never_closed_to_make_room(server):
    """Only idle connections give way: requests in progress all complete."""

    async def go() -> list[int]:
        limits = httpx.Limits(max_connections=60, max_keepalive_connections=0)
        async with httpx.AsyncClient(limits=limits, timeout=30) as c:
            rs = await asyncio.gather(*(c.get(server + "/ping") for _ in range(25)))
        return [r.status_code for r in rs]

    assert asyncio.run(go()) == [200] * 25
