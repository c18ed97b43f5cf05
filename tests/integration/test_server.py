"""The foundation: the real server answers, streams, reports its connector, exports metrics."""

from __future__ import annotations

import json

import httpx

from tests import prestart
from tests.conftest import PLAIN_ARGS
from tests.integration.helpers import chat, client, text_of
from tests.server_process import ServerProcess


def test_greedy_answer_mentions_paris(kvbranch_server):
    response = chat(
        kvbranch_server,
        [{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=20,
    )
    assert "Paris" in text_of(response)
    usage = response["usage"]
    assert usage["prompt_tokens"] > 0 and usage["completion_tokens"] > 0
    # --enable-prompt-tokens-details is on: vLLM reports cached tokens
    assert "cached_tokens" in usage["prompt_tokens_details"]
    split = response["kvbranch"]
    assert split["prompt_tokens"] == usage["prompt_tokens"]
    assert (
        split["device_hit_tokens"] + split["host_hit_tokens"] + split["recomputed_tokens"]
        == usage["prompt_tokens"]
    )


def test_streaming_returns_chunks_then_done(kvbranch_server):
    body = {
        "model": kvbranch_server.model,
        "temperature": 0,
        "max_tokens": 10,
        "stream": True,
        "stream_options": {"include_usage": True},
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
    }
    events = []
    with client(kvbranch_server) as c, c.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: ") :])
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    content = "".join(
        ch["choices"][0]["delta"].get("content") or "" for ch in chunks if ch["choices"]
    )
    assert len([ch for ch in chunks if ch["choices"]]) >= 2
    assert "Paris" in content
    usage_chunks = [ch for ch in chunks if ch.get("usage")]
    assert (
        usage_chunks
        and usage_chunks[-1]["kvbranch"]["prompt_tokens"]
        == usage_chunks[-1]["usage"]["prompt_tokens"]
    )


def test_kvbranch_health_reports_connector_loaded(kvbranch_server):
    with client(kvbranch_server) as c:
        health = c.get("/v1/kvbranch/health").json()
    assert health["status"] == "ok"
    assert health["vllm_version"].startswith("0.32")
    assert health["connector"]["loaded"] is True
    assert health["connector"]["block_size"] == 128
    assert health["connector"]["store_capacity_bytes"] > 0


def test_metrics_exports_kvbranch_counters(kvbranch_server):
    chat(kvbranch_server, [{"role": "user", "content": "Say hi."}], max_tokens=2)
    r = httpx.get(f"{kvbranch_server.url}/metrics", timeout=30)
    assert r.status_code == 200
    assert "vllm:" in r.text  # vLLM's own metrics are still there
    assert "kvbranch_connector_up 1.0" in r.text
    assert 'kvbranch_prompt_tokens_total{source="recomputed"}' in r.text
    assert "kvbranch_store_capacity_bytes" in r.text
    assert "kvbranch_host_copy_seconds_bucket" in r.text  # vLLM's connector-stats plumbing
    # The warm-first scheduler (on by default on CPU) publishes its decisions from the engine.
    assert "kvbranch_scheduler_backfills_total" in r.text
    assert "kvbranch_scheduler_preemptions_total" in r.text
    assert "kvbranch_scheduler_paused_steps_total" in r.text


#: kvbranch's launcher with ``--no-connector`` (one test uses it: stopped after it, not kept
#: beside the later modules' servers; launched ahead of the module: tests/prestart.py).
no_connector_server = prestart.fixture(
    "no_connector_server",
    lambda: (ServerProcess(PLAIN_ARGS, name="no-connector"),),
    scope="module",
)


def test_no_connector_server_reports_connector_not_loaded(no_connector_server):
    with client(no_connector_server) as c:
        health = c.get("/v1/kvbranch/health").json()
        assert health["connector"]["loaded"] is False
        r = c.post("/v1/kvbranch/sessions", json={})
    assert r.status_code == 503
    assert "not loaded" in r.json()["error"]["message"]
