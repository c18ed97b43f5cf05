"""The upstream P/D baseline's proxy logic (benchmarks/upstream_pd): D's params carried to the
conversation's next P turn — one use, dropped 5 s before D's TTL, a fork's first turn takes its
parent's — the usage chunk that brings them out of D's stream, and a P leg that fails with
D's params sent again without them. No servers: fakes of P and D answer in vLLM's shapes."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import httpx
from starlette.testclient import TestClient

from benchmarks.upstream_pd.carry import ParamsCarry, prefill_params
from benchmarks.upstream_pd.proxy import Proxy, build_app, conversation_key, prefill_leg
from benchmarks.upstream_pd.stream_params import with_params, wrap

MAIN = ("s1", "main")
ALT = ("s1", "alt0")


def d_params(blocks: list[int], tokens: int = 256) -> dict:
    """What vLLM's NixlConnector on D returns at the end of a turn (bidirectional mode)."""
    return {
        "do_remote_prefill": False,
        "do_remote_decode": True,
        "remote_block_ids": [blocks],
        "remote_engine_id": "d-engine",
        "remote_request_id": "req-1",
        "remote_host": "127.0.0.1",
        "remote_port": 18002,
        "remote_num_tokens": tokens,
    }


def test_params_are_used_once():
    carry = ParamsCarry(ttl_s=30)
    carry.file(MAIN, d_params([1, 2]), now=0.0)
    assert carry.take(MAIN, now=1.0) == d_params([1, 2])
    assert carry.take(MAIN, now=1.1) is None


def test_params_are_dropped_five_seconds_before_the_hold_ends():
    carry = ParamsCarry(ttl_s=30)
    carry.file(MAIN, d_params([1]), now=100.0)
    assert carry.take(MAIN, now=124.9) is not None
    carry.file(MAIN, d_params([1]), now=100.0)
    assert carry.take(MAIN, now=125.0) is None
    assert carry.counts["expired"] == 1


def test_a_later_turn_replaces_the_earlier_handle():
    carry = ParamsCarry(ttl_s=30)
    carry.file(MAIN, d_params([1]), now=0.0)
    carry.file(MAIN, d_params([1, 2, 3], tokens=300), now=1.0)
    assert carry.take(MAIN, now=2.0)["remote_num_tokens"] == 300
    carry.file(MAIN, None, now=3.0)  # a turn D returned nothing for: nothing stale is offered
    assert carry.take(MAIN, now=3.0) is None


def test_a_forks_first_turn_takes_its_parents_handle_once():
    carry = ParamsCarry(ttl_s=30)
    carry.file(MAIN, d_params([7]), now=0.0)
    assert carry.take(ALT, now=1.0, parent=MAIN) == d_params([7])
    assert carry.take(("s1", "alt1"), now=1.0, parent=MAIN) is None  # one use, even for forks
    assert carry.counts["taken_from_parent"] == 1


def test_a_branch_past_its_first_turn_never_takes_its_parents_handle():
    carry = ParamsCarry(ttl_s=30)
    carry.file(ALT, d_params([3]), now=0.0)
    assert carry.take(ALT, now=1.0, parent=MAIN) is not None
    carry.file(MAIN, d_params([7]), now=2.0)
    assert carry.take(ALT, now=3.0, parent=MAIN) is None
    assert carry.take(MAIN, now=3.0) is not None  # still main's own


def test_sessions_do_not_share_handles():
    carry = ParamsCarry(ttl_s=30)
    carry.file(MAIN, d_params([1]), now=0.0)
    assert carry.take(("s2", "main"), now=1.0, parent=("s2", "main")) is None


def test_prefill_leg_asks_p_to_hold_or_to_pull():
    fresh = prefill_params(None)
    assert fresh["do_remote_decode"] is True and fresh["remote_block_ids"] is None
    pull = prefill_params(d_params([4]))
    assert pull["remote_block_ids"] == [[4]] and pull["do_remote_prefill"] is False
    body = {"messages": [], "stream": True, "stream_options": {}, "max_tokens": 32, "min_tokens": 4}
    leg = prefill_leg(body, None)
    assert leg["max_tokens"] == 1 and leg["stream"] is False and "min_tokens" not in leg
    assert "stream_options" not in leg and body["max_tokens"] == 32  # the client's body kept


def test_the_conversation_key_comes_from_headers_or_body_and_leaves_the_body_plain():
    body = {"session_id": "s1", "vllm_xargs": {"kvbranch_branch": "alt0"}, "messages": []}
    assert conversation_key({}, body) == ("s1", "alt0")
    assert body == {"messages": []}
    assert conversation_key({"X-Session-ID": "s9"}, {}) == ("s9", "main")
    assert conversation_key({}, {"messages": []}) is None


def usage_event(extra: dict) -> bytes:
    chunk = {"id": "x", "choices": [], "usage": {"prompt_tokens": 500}, **extra}
    return b"data: " + json.dumps(chunk).encode()


def test_the_usage_chunk_files_ds_params_and_the_client_never_sees_them():
    proxy = Proxy("http://p", "http://d", ttl_s=30)
    out = proxy.event(usage_event({"kv_transfer_params": d_params([5])}), MAIN, True, 300)
    chunk = json.loads(out[len(b"data: ") :])
    assert "kv_transfer_params" not in chunk
    assert chunk["usage"]["prompt_tokens_details"]["cached_tokens"] == 300  # P's, not D's
    assert proxy.carry.held[MAIN].params["remote_block_ids"] == [[5]]
    assert proxy.carry.take(MAIN, now=0.0) is not None
    proxy.event(usage_event({"kv_transfer_params": d_params([6])}), MAIN, False, None)
    assert proxy.carry.held[MAIN].params["remote_block_ids"] == [[6]]


def test_a_usage_chunk_the_client_did_not_ask_for_is_dropped_and_content_passes():
    proxy = Proxy("http://p", "http://d", ttl_s=30)
    assert proxy.event(usage_event({}), MAIN, False, None) is None
    content = b'data: {"choices":[{"delta":{"content":"hi"}}],"usage":null}'
    assert proxy.event(content, MAIN, False, None) == content
    assert proxy.event(b"data: [DONE]", MAIN, False, None) == b"data: [DONE]"


def test_ds_stream_gets_its_params_in_the_usage_chunk_only():
    params = d_params([9])
    usage = 'data: {"choices":[],"usage":{"prompt_tokens":3}}\n\n'
    assert json.loads(with_params(usage, params)[6:])["kv_transfer_params"] == params
    content = 'data: {"choices":[{"delta":{"content":"a"}}]}\n\n'
    assert with_params(content, params) == content
    assert with_params(usage, None) == usage


def test_the_wrapped_stream_generator_adds_the_last_outputs_params_to_the_usage_chunk():
    async def stream_generator(self, request, result_generator, request_id):  # vLLM's shape
        async for _ in result_generator:
            yield 'data: {"choices":[{"delta":{"content":"a"}}]}\n\n'
        yield 'data: {"choices":[],"usage":{"prompt_tokens":3}}\n\n'
        yield "data: [DONE]\n\n"

    async def outputs():
        yield SimpleNamespace(kv_transfer_params=None)
        yield (0, SimpleNamespace(kv_transfer_params=d_params([8])))  # text completions' shape

    async def collect():
        return [p async for p in wrap(stream_generator)(None, None, outputs(), request_id="r")]

    pieces = asyncio.run(collect())
    assert json.loads(pieces[2][6:])["kv_transfer_params"] == d_params([8])
    assert "kv_transfer_params" not in pieces[0] and pieces[-1] == "data: [DONE]\n\n"


def fake_cluster(p_status: list[int]) -> tuple[Proxy, list[dict], list[dict]]:
    """A proxy whose P answers with ``p_status`` in turn (then 200) and whose D streams one
    token and a usage chunk with its params (vLLM's shapes; no servers)."""
    p_calls: list[dict] = []
    d_calls: list[dict] = []

    def handle(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        if request.url.host == "p":
            p_calls.append(body)
            status = p_status[len(p_calls) - 1] if len(p_calls) <= len(p_status) else 200
            usage = {"prompt_tokens": 500, "prompt_tokens_details": {"cached_tokens": 384}}
            answer = {"choices": [], "usage": usage, "kv_transfer_params": {"from": "p"}}
            return httpx.Response(status, json=answer if status == 200 else {"error": "x"})
        d_calls.append(body)
        usage = {
            "choices": [],
            "usage": {"prompt_tokens": 500},
            "kv_transfer_params": d_params([5]),
        }
        events = [{"choices": [{"delta": {"content": "hi"}}]}, usage]
        sse = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
        return httpx.Response(200, text=sse, headers={"content-type": "text/event-stream"})

    proxy = Proxy("http://p", "http://d", ttl_s=30)
    proxy.client = httpx.AsyncClient(transport=httpx.MockTransport(handle))
    return proxy, p_calls, d_calls


def stream_turn(proxy: Proxy, usage: bool = True) -> list[dict]:
    body = {"messages": [], "stream": True, "session_id": "s1", "max_tokens": 8}
    if usage:
        body["stream_options"] = {"include_usage": True}
    with TestClient(build_app(proxy)) as client:
        text = client.post("/v1/chat/completions", json=body).text
    return [json.loads(e[6:]) for e in text.split("\n\n") if e.startswith("data: {")]


def test_a_streamed_turn_carries_ds_params_to_the_next_prefill():
    proxy, p_calls, d_calls = fake_cluster([])
    events = stream_turn(proxy)
    assert p_calls[0]["kv_transfer_params"]["remote_block_ids"] is None  # nothing to pull yet
    assert d_calls[0]["kv_transfer_params"] == {"from": "p"} and "session_id" not in d_calls[0]
    assert "kv_transfer_params" not in events[-1]
    assert events[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] == 384  # P's
    stream_turn(proxy, usage=False)
    assert p_calls[1]["kv_transfer_params"]["remote_block_ids"] == [[5]]  # D's, one turn later


def test_a_prefill_that_fails_with_ds_params_is_sent_again_without_them():
    proxy, p_calls, _ = fake_cluster([200, 500])
    stream_turn(proxy)
    events = stream_turn(proxy, usage=False)  # P fails the pull (vLLM's "fail" policy)
    assert [c["kv_transfer_params"]["remote_block_ids"] for c in p_calls] == [None, [[5]], None]
    assert proxy.retried == 1 and events[0]["choices"][0]["delta"]["content"] == "hi"
    assert all("usage" not in e for e in events)  # the client did not ask for it
