"""/metrics never blocks the API event loop on the control socket: the refresh layer fetches
the connector's stats with the async client, the collector serves that snapshot, and a
connector that does not answer is reported down (``kvbranch_connector_up`` 0)."""

from __future__ import annotations

import asyncio
import json
import os
import tempfile

from server.connector.control.models import EngineStats, EngineStoreStats
from server.plugin import metrics


def _serve_stats(path: str, stats: dict, seen: list[str]):
    async def handle(reader, writer):
        line = await reader.readline()
        seen.append(json.loads(line)["op"])
        writer.write((json.dumps({"ok": True, "result": stats}) + "\n").encode())
        await writer.drain()
        writer.close()

    return asyncio.start_unix_server(handle, path)


#: A whole ``stats`` answer (the collector parses it into ``EngineStats``, strictly).
STATS = {
    **dict.fromkeys(EngineStats.model_fields, 0),
    "store": {
        **dict.fromkeys(EngineStoreStats.model_fields, 0),
        "evictions": 1,
        "saved_blocks": 2,
        "loaded_blocks": 3,
        "used_bytes": 4,
        "capacity_blocks": 5,
        "block_bytes": 6,
        "pinned_bytes": 7,
        "pin_budget_bytes": 8,
    },
    "hits_tokens": {"device": 9},
    "requests": 10,
    "sessions": [],
    "pd": None,
    "scheduler": {"preemptions": 11, "backfills": 12, "passed_requests": 13, "paused_steps": 14},
}


def test_a_scrape_is_served_from_the_async_snapshot(monkeypatch):
    def no_sync_call(*a, **k):
        raise AssertionError("the collector blocked on the control socket")

    monkeypatch.setattr(metrics, "call_sync", no_sync_call)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "c.sock")
        seen: list[str] = []
        collector = metrics.KVBranchCollector(path)
        monkeypatch.setitem(metrics._registered, path, collector)

        async def go():
            server = await _serve_stats(path, STATS, seen)
            async with server:
                reached = []

                async def app(scope, receive, send):
                    reached.append(list(collector.collect()))

                await metrics.MetricsRefresh(app)({"type": "http", "path": "/metrics"}, None, None)
                return reached

        families = asyncio.run(go())[0]
    assert seen == ["stats"]
    values = {f.name: f.samples[0].value for f in families if f.samples}
    assert values["kvbranch_connector_up"] == 1 and values["kvbranch_requests"] == 10
    assert values["kvbranch_scheduler_preemptions"] == 11
    assert values["kvbranch_scheduler_backfills"] == 12
    assert values["kvbranch_scheduler_paused_steps"] == 14


def test_a_connector_that_does_not_answer_is_down_without_a_blocking_call(monkeypatch):
    monkeypatch.setattr(metrics, "call_sync", lambda *a, **k: (_ for _ in ()).throw(AssertionError))
    collector = metrics.KVBranchCollector("/nonexistent/kvbranch.sock")
    asyncio.run(collector.refresh())
    families = list(collector.collect())
    assert families[0].name == "kvbranch_connector_up" and families[0].samples[0].value == 0
