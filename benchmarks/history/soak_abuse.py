"""The hostile half of the cluster soak (:mod:`benchmarks.history.soak`, issue 37 item 8):
what an attacker or a broken client sends to the routers while legitimate tenants are served.

* :func:`abuse_cases` — one request per kind of malformed input the router's edge must refuse
  (lone surrogates, deep JSON, ``"stream": 1``, bad ids, raw bytes in headers, wrong types,
  no or a wrong key), each with the statuses that count as refused properly. Pure: the unit
  tests check the list without a server.
* :func:`send_case`, :func:`flood`, :func:`over_share`, :func:`idle_sockets` — bounded rounds
  of that traffic against one router (every loop has a count; every request a timeout), each
  answer handed to a ``record`` callback as an :class:`Outcome`.

Kept apart from the soak's orchestration so that the list of probes reads on its own and grows
with the router's edge.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from sdk.contract import BRANCH_XARG, CHAT_COMPLETIONS_PATH, SESSIONS_PATH

#: The abusive tenant's statuses for a request over its in-flight share: served, or refused.
OVER_SHARE_OK = frozenset({200, 429})


@dataclass(frozen=True)
class AbuseCase:
    """One hostile request: raw body bytes, raw header values (``bytes`` where a header is not
    ASCII), whether the abusive tenant's key is sent, and what a correct router answers."""

    name: str
    path: str
    body: bytes
    expect: frozenset[int]
    headers: dict[str, str | bytes] = field(default_factory=dict)
    keyed: bool = True


@dataclass
class Outcome:
    """What one request of the soak got back (legitimate or not): ``status`` None when no HTTP
    answer came (``error`` says why)."""

    tenant: str
    kind: str
    case: str
    router: int
    t0: float
    t1: float
    status: int | None = None
    error: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "tenant": self.tenant,
            "kind": self.kind,
            "case": self.case,
            "router": self.router,
            "t0": round(self.t0, 3),
            "t1": round(self.t1, 3),
            "status": self.status,
            "error": self.error,
            **self.extra,
        }


Record = Callable[[Outcome], None]


def _chat(model: str, fields: str, content: str = '"hi"') -> bytes:
    """A small chat body with ``fields`` (and the message's ``content``) spliced in as raw JSON
    text, so that a lone surrogate can travel as the JSON escape ``\\ud800``, which no JSON
    encoder writes."""
    head = json.dumps({"model": model, "messages": [{"role": "user", "content": "@"}]})
    head = head.replace('"@"', content)
    return (head[:-1] + ', "max_tokens": 2' + (", " + fields if fields else "") + "}").encode()


def abuse_cases(model: str, rng: random.Random) -> list[AbuseCase]:
    """The malformed requests of one round (fresh random ids each round, so nothing repeats in
    a cache). Every keyed case is the abusive tenant's; 400 means the edge named the problem,
    401 that it refused the caller before reading anything."""
    sid = f"abuse-{rng.randrange(16**8):08x}"
    c400, c401 = frozenset({400}), frozenset({401})
    chat = CHAT_COMPLETIONS_PATH
    return [
        AbuseCase("no-key", chat, _chat(model, f'"session_id": "{sid}"'), c401, keyed=False),
        AbuseCase(
            "wrong-key",
            chat,
            _chat(model, f'"session_id": "{sid}"'),
            c401,
            {"Authorization": f"Bearer not-a-key-{sid}"},
            keyed=False,
        ),
        AbuseCase(
            "no-key-huge-session",
            chat,
            _chat(model, '"session_id": "' + "x" * 200_000 + '"'),
            c401,
            keyed=False,
        ),
        AbuseCase("session-surrogate", chat, _chat(model, '"session_id": "\\ud800"'), c400),
        AbuseCase(
            "branch-surrogate",
            chat,
            _chat(model, f'"session_id": "{sid}", "vllm_xargs": {{"{BRANCH_XARG}": "\\udfff"}}'),
            c400,
        ),
        AbuseCase("content-surrogate", chat, _chat(model, "", content='"a\\ud800b"'), c400),
        AbuseCase("stream-int", chat, _chat(model, '"stream": 1'), c400),
        AbuseCase("session-path-id", chat, _chat(model, '"session_id": "../etc"'), c400),
        AbuseCase("session-long-id", chat, _chat(model, '"session_id": "' + "s" * 129 + '"'), c400),
        AbuseCase("deep-json", chat, b"[" * 1000 + b"]" * 1000, c400),
        AbuseCase("not-json", chat, b'{"model": "x", "messages": [', c400),
        AbuseCase("max-tokens-string", chat, _chat(model, '"max_tokens": "ten"'), c400),
        AbuseCase("n-zero", chat, _chat(model, '"n": 0'), c400),
        AbuseCase("min-over-max", chat, _chat(model, '"min_tokens": 5'), c400),
        AbuseCase("header-session-byte", chat, _chat(model, ""), c400, {"X-Session-ID": b"\xe9"}),
        AbuseCase(
            "header-auth-byte",
            chat,
            _chat(model, ""),
            c400,
            {"Authorization": b"Bearer \xe9"},
            keyed=False,
        ),
        AbuseCase("session-route-surrogate", SESSIONS_PATH, b'{"session_id": "\\ud800"}', c400),
        AbuseCase("session-route-bad-id", SESSIONS_PATH, b'{"session_id": "a/b"}', c400),
    ]


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:200]


async def send_case(
    client: httpx.AsyncClient,
    url: str,
    router: int,
    case: AbuseCase,
    key: str,
    record: Record,
    tenant: str = "C",
) -> None:
    """One hostile request; its answer (or the lack of one) recorded as ``malformed``."""
    headers: dict[str, str | bytes] = {"content-type": "application/json"}
    if case.keyed:
        headers["Authorization"] = f"Bearer {key}"
    headers.update(case.headers)
    t0 = time.monotonic()
    out = Outcome(tenant if case.keyed else "anonymous", "malformed", case.name, router, t0, t0)
    try:
        r = await client.post(url + case.path, content=case.body, headers=headers, timeout=60)
        out.status = r.status_code
        if r.status_code not in case.expect:
            out.extra["body"] = r.text[:300]
    except httpx.HTTPError as exc:
        out.error = _error(exc)
    out.t1 = time.monotonic()
    out.extra["expected"] = sorted(case.expect)
    record(out)


async def flood(
    client: httpx.AsyncClient,
    url: str,
    router: int,
    model: str,
    n: int,
    rng: random.Random,
    record: Record,
    concurrency: int = 8,
) -> None:
    """``n`` chats without a valid key (half none, half a made-up one), each with a fresh
    session id: every one must be a 401, and none may reach the index."""
    sem = asyncio.Semaphore(concurrency)

    async def one(i: int) -> None:
        body = _chat(model, f'"session_id": "flood-{rng.randrange(16**12):012x}"')
        headers = {"content-type": "application/json"}
        if i % 2:
            headers["Authorization"] = f"Bearer forged-{i}"
        async with sem:
            t0 = time.monotonic()
            out = Outcome(
                "anonymous",
                "flood",
                "no-key" if i % 2 == 0 else "forged-key",
                router,
                t0,
                t0,
                extra={"expected": [401]},
            )
            try:
                r = await client.post(
                    url + CHAT_COMPLETIONS_PATH, content=body, headers=headers, timeout=60
                )
                out.status = r.status_code
            except httpx.HTTPError as exc:
                out.error = _error(exc)
            out.t1 = time.monotonic()
            record(out)

    await asyncio.gather(*(one(i) for i in range(n)))


async def over_share(
    client: httpx.AsyncClient,
    url: str,
    router: int,
    model: str,
    key: str,
    n: int,
    record: Record,
) -> None:
    """``n`` tiny chats of the abusive tenant at once (past its in-flight share at this router):
    each is served or refused with 429 and a ``Retry-After``."""

    async def one(i: int) -> None:
        body = {
            "model": model,
            "messages": [{"role": "user", "content": f"Count to {i}."}],
            "max_tokens": 2,
            "temperature": 0,
        }
        t0 = time.monotonic()
        out = Outcome(
            "C", "over-share", "burst", router, t0, t0, extra={"expected": sorted(OVER_SHARE_OK)}
        )
        try:
            r = await client.post(
                url + CHAT_COMPLETIONS_PATH,
                json=body,
                headers={"Authorization": f"Bearer {key}"},
                timeout=300,
            )
            out.status = r.status_code
            if r.status_code == 429 and not r.headers.get("retry-after"):
                out.extra["no_retry_after"] = True
        except httpx.HTTPError as exc:
            out.error = _error(exc)
        out.t1 = time.monotonic()
        record(out)

    await asyncio.gather(*(one(i) for i in range(n)))


async def idle_sockets(host: str, port: int, n: int, hold_s: float) -> int:
    """Open ``n`` TCP connections that never send a byte, hold them ``hold_s`` seconds, close
    them; how many opened (the router may close idle ones to make room: that is its defence)."""
    writers: list[asyncio.StreamWriter] = []
    try:
        for _ in range(n):
            try:
                _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), 5)
            except (OSError, asyncio.TimeoutError):
                break
            writers.append(writer)
        await asyncio.sleep(hold_s)
        return len(writers)
    finally:
        for writer in writers:
            writer.close()
