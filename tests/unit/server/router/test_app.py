"""The assembled app: its lifespan sweeps the index on a timer."""

from __future__ import annotations

import time

from starlette.testclient import TestClient

from server.router.app import build_app
from tests.unit.server.router.fakes import D, Fakes, P, make_router, put


def test_the_app_sweeps_the_index_on_a_timer_without_any_read():
    router = make_router(Fakes(), ttl=0.05)
    with TestClient(build_app(router)):
        put(router, ("t", "s", "main"), D, "x", {"remote_num_tokens": 5})
        deadline = time.monotonic() + 5
        while router.index.counters()["entries"] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert router.index.counters()["entries"] == 0, "expired entry never swept"


def test_the_router_drops_idle_connections_before_the_instances_close_them():
    """Equal keep-alives race: a request sent on a connection the instance closes at that
    moment fails with ReadError (RESULTS.md agent_workload 2026-12-03 09:05, a fork to P)."""
    import vllm.envs

    from server.router.app import KEEPALIVE_EXPIRY_S, Router

    router = Router([P], [D], hold_ttl_s=60.0)
    expiry = router.pool.client._transport._pool._keepalive_expiry
    assert expiry == KEEPALIVE_EXPIRY_S < vllm.envs.VLLM_HTTP_TIMEOUT_KEEP_ALIVE
