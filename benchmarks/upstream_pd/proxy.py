"""The upstream P/D baseline's proxy: vLLM's example P/D proxy plus D's params carried to the
conversation's next turn on P (vLLM's bidirectional mode needs a proxy that does this; vLLM's
own examples do not).

    python -m benchmarks.upstream_pd.proxy --port 8100 --prefill URL --decode URL --ttl-s 30

Each turn, as ``tests/v1/kv_connector/nixl_integration/toy_proxy_server.py`` does it: P with
``max_tokens=1``, not streamed, ``min_tokens`` dropped, and ``kv_transfer_params`` asking it to
hold the prompt for D; then D with the client's request and P's params, D's answer relayed as
it comes. Added: P's leg carries D's params from the conversation's last turn
(:mod:`benchmarks.upstream_pd.carry`: keyed by session and branch, one use, dropped 5 s before
D's TTL, a fork's first turn may take its parent's), and D's leg always asks for the usage
chunk, where D's params arrive (:mod:`benchmarks.upstream_pd.stream_params`); the params are
taken out before the client sees the chunk, and its ``prompt_tokens_details.cached_tokens`` are
P's (what P did not compute: its prefix cache and the pull), not D's (D reads every prompt
block from P), so that a client's "recomputed" is what P computed. A P leg that fails (HTTP
5xx) while carrying D's params, e.g. vLLM's ``fail`` policy on a pull that expired, is sent
once more without them.

The session is ``X-Session-ID`` or the body's ``session_id``; the branch ``X-KVBranch-Branch``
or ``vllm_xargs.kvbranch_branch`` (default ``main``, the parent of every other branch); both
body fields are removed before vLLM sees the request. ``GET /proxy/stats``: the carry's counts,
P legs retried. Responses carry ``Server-Timing`` as kvbranch's router sends it: ``prefill``
(P's leg) and, streamed, ``decode`` (D's leg up to its answer's headers), in ms.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from benchmarks.upstream_pd.carry import Key, ParamsCarry, prefill_params
from sdk.contract import BRANCH_HEADER, BRANCH_XARG, DEFAULT_BRANCH, SESSION_HEADER

FIELD = "kv_transfer_params"


def conversation_key(headers: Any, body: dict[str, Any]) -> Key | None:
    """(session, branch) of a request, taking the kvbranch body fields out of ``body``."""
    session = headers.get(SESSION_HEADER) or body.pop("session_id", None)
    xargs = body.get("vllm_xargs")
    branch = headers.get(BRANCH_HEADER)
    if isinstance(xargs, dict):
        branch = branch or xargs.pop(BRANCH_XARG, None)
        if not xargs:
            body.pop("vllm_xargs")
    if not session:
        return None
    return str(session), str(branch or DEFAULT_BRANCH)


def prefill_leg(body: dict[str, Any], carried: dict[str, Any] | None) -> dict[str, Any]:
    leg = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    leg.update(stream=False, max_tokens=1, kv_transfer_params=prefill_params(carried))
    if "max_completion_tokens" in leg:
        leg["max_completion_tokens"] = 1
    leg.pop("min_tokens", None)
    leg.pop("min_completion_tokens", None)
    return leg


def cached_tokens(answer: dict[str, Any]) -> int | None:
    details = (answer.get("usage") or {}).get("prompt_tokens_details") or {}
    value = details.get("cached_tokens")
    return int(value) if value is not None else None


def set_cached_tokens(answer: dict[str, Any], cached: int | None) -> None:
    usage = answer.get("usage")
    if cached is not None and isinstance(usage, dict):
        usage["prompt_tokens_details"] = dict(
            usage.get("prompt_tokens_details") or {}, cached_tokens=cached
        )


class Proxy:
    def __init__(self, prefill: str, decode: str, ttl_s: float) -> None:
        self.prefill, self.decode = prefill.rstrip("/"), decode.rstrip("/")
        self.carry = ParamsCarry(ttl_s)
        self.client = httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=None))
        self.retried = 0

    async def turn(self, request: Request) -> Response:
        body = await request.json()
        key = conversation_key(request.headers, body)
        parent = (key[0], DEFAULT_BRANCH) if key else None
        carried = self.carry.take(key, time.monotonic(), parent) if key else None
        path = request.url.path
        t0 = time.perf_counter()
        p = await self.client.post(self.prefill + path, json=prefill_leg(body, carried))
        if p.status_code >= 500 and carried is not None:
            self.retried += 1
            p = await self.client.post(self.prefill + path, json=prefill_leg(body, None))
        prefill_ms = (time.perf_counter() - t0) * 1000
        timing = {"Server-Timing": f"prefill;dur={prefill_ms:.1f}"}
        if p.status_code != 200:
            return Response(p.content, p.status_code, media_type="application/json")
        prefilled = p.json()
        cached = cached_tokens(prefilled)
        leg = dict(body, kv_transfer_params=prefilled.get(FIELD))
        if not body.get("stream"):
            d = await self.client.post(self.decode + path, json=leg)
            answer = d.json()
            if isinstance(answer, dict):
                self.file(key, answer.pop(FIELD, None))
                set_cached_tokens(answer, cached)
            return JSONResponse(answer, d.status_code, headers=timing)
        wants_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        leg["stream_options"] = dict(body.get("stream_options") or {}, include_usage=True)
        d_req = self.client.build_request("POST", self.decode + path, json=leg)
        t1 = time.perf_counter()
        d = await self.client.send(d_req, stream=True)
        decode_ms = (time.perf_counter() - t1) * 1000
        timing = {"Server-Timing": f"prefill;dur={prefill_ms:.1f}, decode;dur={decode_ms:.1f}"}
        if d.status_code != 200:
            content = await d.aread()
            await d.aclose()
            return Response(content, d.status_code, media_type="application/json")
        return StreamingResponse(
            self.relay(d, key, wants_usage, cached), media_type="text/event-stream", headers=timing
        )

    async def relay(
        self, d: httpx.Response, key: Key | None, wants_usage: bool, cached: int | None
    ) -> AsyncIterator[bytes]:
        buffer = b""
        try:
            async for data in d.aiter_bytes():
                buffer += data
                while b"\n\n" in buffer:
                    event, buffer = buffer.split(b"\n\n", 1)
                    out = self.event(event, key, wants_usage, cached)
                    if out is not None:
                        yield out + b"\n\n"
            if buffer.strip():
                yield buffer
        finally:
            await d.aclose()

    def event(
        self, event: bytes, key: Key | None, wants_usage: bool, cached: int | None
    ) -> bytes | None:
        """One SSE event of D's stream as the client gets it (None: dropped)."""
        if not event.startswith(b"data: {") or b'"usage"' not in event:
            return event
        chunk = json.loads(event[len(b"data: ") :])
        if chunk.get("choices") or "usage" not in chunk:
            return event
        self.file(key, chunk.pop(FIELD, None))
        set_cached_tokens(chunk, cached)
        if not wants_usage:
            return None
        return b"data: " + json.dumps(chunk, separators=(",", ":")).encode()

    def file(self, key: Key | None, params: dict[str, Any] | None) -> None:
        if key is not None:
            self.carry.file(key, params, time.monotonic())

    async def passthrough(self, request: Request) -> Response:
        r = await self.client.get(self.decode + request.url.path)
        return Response(r.content, r.status_code, media_type=r.headers.get("content-type"))

    async def stats(self, request: Request) -> Response:
        return JSONResponse({**self.carry.counts, "prefill_retried": self.retried})


def build_app(proxy: Proxy) -> Starlette:
    return Starlette(
        routes=[
            Route("/v1/chat/completions", proxy.turn, methods=["POST"]),
            Route("/v1/completions", proxy.turn, methods=["POST"]),
            Route("/v1/models", proxy.passthrough, methods=["GET"]),
            Route("/health", proxy.passthrough, methods=["GET"]),
            Route("/proxy/stats", proxy.stats, methods=["GET"]),
        ]
    )


def main(argv: list[str] | None = None) -> None:
    from server.launcher.process import die_with_launcher

    ap = argparse.ArgumentParser(prog="python -m benchmarks.upstream_pd.proxy")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--prefill", required=True)
    ap.add_argument("--decode", required=True)
    ap.add_argument("--ttl-s", type=float, default=30.0, help="D's decoder_kv_blocks_ttl")
    args = ap.parse_args(argv)
    die_with_launcher()
    app = build_app(Proxy(args.prefill, args.decode, args.ttl_s))
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
