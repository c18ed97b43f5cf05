"""An in-process fake kvbranch server for tests (no engine, no network): an httpx
``MockTransport`` that speaks the chat API (plain and SSE streamed, tool calls), the
``/v1/kvbranch`` routes of :mod:`sdk.contract`, and injectable failures.

    fake = FakeKVBranchServer()
    client = KVBranchClient("http://fake", transport=fake.transport(), retry=fast_retry)
    fake.fail_next(503, headers={"Retry-After": "2"})   # the next request gets a 503
    fake.lose_state()                                  # like a server restart

Answers are deterministic functions of the messages (``reply``), so tests can check that a
conversation continues identically after the fake lost its state. Every kvbranch answer is built
through the contract's response models (:mod:`sdk.contract`), so the fake cannot drift from
the server's wire format. Meant for the sdk's tests and
for integrations built on the sdk; it is not a model of the real server's cache.
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Callable
from typing import Any

import httpx

from sdk import contract
from sdk._fake_chat import (
    EventStream,
    FakeToolCall,
    Reply,
    default_reply,
    raiser,
    responder,
    stream_chunks,
    tokens,
)
from sdk.contract import (
    API_PREFIX,
    BRANCH_XARG,
    CHAT_COMPLETIONS_PATH,
    DEFAULT_BRANCH,
    HEALTH_PATH,
    MODELS_PATH,
    RESPONSE_FIELD,
    SESSIONS_PATH,
    STATS_PATH,
    error_body,
)

__all__ = ["FakeKVBranchServer", "Reply", "FakeToolCall", "default_reply"]


class FakeKVBranchServer:
    def __init__(
        self,
        *,
        kvbranch: bool = True,
        model: str = "fake-model",
        reply: Callable[[list[dict[str, Any]]], Reply] = default_reply,
        stream_piece: int = 4,
    ) -> None:
        self.kvbranch = kvbranch
        self.model = model
        self.reply = reply
        self.stream_piece = stream_piece
        self.sessions: dict[str, dict[str, Any]] = {}
        self.requests: list[tuple[str, str, Any, httpx.Headers]] = []
        self._failures: list[Callable[[httpx.Request], httpx.Response]] = []
        self._ids = itertools.count(1)
        self.stats = {"device": 0, "host": 0, "recomputed": 0, "requests": 0, "prefetches": 0}

    # --- test controls --------------------------------------------------------------------
    def transport(self) -> httpx.MockTransport:
        """For ``KVBranchClient`` and ``AsyncKVBranchClient`` alike."""
        return httpx.MockTransport(self.handle)

    def fail_next(
        self,
        status_or_exc: int | Exception,
        *,
        body: Any = None,
        headers: dict[str, str] | None = None,
        times: int = 1,
    ) -> None:
        """The next ``times`` requests fail with this status (JSON ``body``, default the
        kvbranch error format) or raise this exception (e.g. ``httpx.ConnectError``)."""
        for _ in range(times):
            if isinstance(status_or_exc, Exception):
                self._failures.append(raiser(status_or_exc))
            else:
                payload = (
                    body
                    if body is not None
                    else error_body(status_or_exc, f"injected {status_or_exc}")
                )
                self._failures.append(responder(status_or_exc, payload, headers))

    def break_next_stream(self, after_events: int) -> None:
        """The next streamed answer sends ``after_events`` events, then the connection
        breaks (``httpx.ReadError``)."""
        self._break_after = after_events

    def lose_state(self) -> None:
        """Forget every session and branch, as a restarted server does."""
        self.sessions.clear()

    def chat_requests(self) -> list[dict[str, Any]]:
        return [body for method, path, body, _ in self.requests if path == CHAT_COMPLETIONS_PATH]

    def paths(self) -> list[str]:
        return [f"{method} {path}" for method, path, _, _ in self.requests]

    # --- the server -----------------------------------------------------------------------
    _break_after: int | None = None

    def handle(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else None
        path = request.url.path
        self.requests.append((request.method, path, body, request.headers))
        if self._failures:
            return self._failures.pop(0)(request)
        if path == MODELS_PATH and request.method == "GET":
            return httpx.Response(
                200, json={"object": "list", "data": [{"id": self.model, "object": "model"}]}
            )
        if path == CHAT_COMPLETIONS_PATH and request.method == "POST":
            return self._chat(body or {})
        if path.startswith(API_PREFIX):
            if not self.kvbranch:
                return httpx.Response(404, json={"detail": "Not Found"})
            return self._kvbranch(request.method, path, body)
        return httpx.Response(404, json={"detail": "Not Found"})

    @staticmethod
    def _error(status: int, message: str) -> httpx.Response:
        return httpx.Response(status, json=error_body(status, message))

    def _session(self, sid: str, **settings: Any) -> dict[str, Any]:
        session = {
            "session_id": sid,
            "created_at": time.time(),
            "auto_pin": settings.get("auto_pin", True),
            "pin_ttl_s": settings.get("pin_ttl_s") or 300.0,
            "branches": {},
        }
        session["branches"][DEFAULT_BRANCH] = self._branch(sid, DEFAULT_BRANCH)
        self.sessions[sid] = session
        return session

    @staticmethod
    def _branch(
        sid: str,
        bid: str,
        parent: str | None = None,
        tokens: list[str] | None = None,
        offset: int | None = None,
    ) -> dict[str, Any]:
        return {
            "session_id": sid,
            "branch_id": bid,
            "parent": parent,
            "fork_offset_tokens": offset,
            "tokens": list(tokens or []),
            "pinned": False,
            "pin_ttl_s": None,
            "requests": 0,
        }

    @staticmethod
    def _branch_info(b: dict[str, Any]) -> dict[str, Any]:
        return contract.BranchInfo(
            session_id=b["session_id"],
            branch_id=b["branch_id"],
            parent=b["parent"],
            fork_offset_tokens=b["fork_offset_tokens"],
            num_tokens=len(b["tokens"]),
            pinned=b["pinned"],
            pin_expires_in_s=b["pin_ttl_s"],
            requests=b["requests"],
        ).model_dump(mode="json")

    def _session_info(self, s: dict[str, Any]) -> dict[str, Any]:
        branches = [
            contract.BranchInfo.model_validate(self._branch_info(b)) for b in s["branches"].values()
        ]
        return contract.SessionInfo(
            session_id=s["session_id"],
            created_at=s["created_at"],
            auto_pin=s["auto_pin"],
            pin_ttl_s=s["pin_ttl_s"],
            branches=branches,
        ).model_dump(mode="json")

    def _health(self) -> dict[str, Any]:
        return contract.HealthInfo(
            status="ok",
            kvbranch_version="fake",
            vllm_version="fake",
            model=self.model,
            connector=contract.ConnectorInfo(loaded=True, name="fake"),
        ).model_dump(mode="json")

    def _stats(self) -> dict[str, Any]:
        store = contract.StoreStats(**dict.fromkeys(contract.StoreStats.model_fields, 0))
        sessions = [
            contract.SessionInfo.model_validate(self._session_info(s))
            for s in self.sessions.values()
        ]
        return contract.Stats(
            store=store,
            hits_tokens={k: self.stats[k] for k in ("device", "host", "recomputed")},
            requests=self.stats["requests"],
            pins_degraded=0,
            pins_refused=0,
            prefetches=self.stats["prefetches"],
            sessions=sessions,
        ).model_dump(mode="json")

    @staticmethod
    def _deleted(what: str) -> httpx.Response:
        return httpx.Response(
            200, json=contract.DeleteResult(deleted=what, released_blocks=0).model_dump(mode="json")
        )

    def _kvbranch(self, method: str, path: str, body: Any) -> httpx.Response:
        if path == HEALTH_PATH:
            return httpx.Response(200, json=self._health())
        if path == STATS_PATH:
            return httpx.Response(200, json=self._stats())
        if path == SESSIONS_PATH and method == "POST":
            create = contract.CreateSessionRequest.model_validate(body or {})
            sid = create.session_id or f"sess_fake{next(self._ids)}"
            if sid in self.sessions:
                return self._error(409, f"session {sid!r} already exists")
            session = self._session(sid, auto_pin=create.auto_pin, pin_ttl_s=create.pin_ttl_s)
            return httpx.Response(201, json=self._session_info(session))
        parts = path[len(SESSIONS_PATH) + 1 :].split("/")
        sid = parts[0]
        found = self.sessions.get(sid)
        if found is None:
            return self._error(404, f"session {sid!r} not found")
        session = found
        if len(parts) == 1:
            if method == "GET":
                return httpx.Response(200, json=self._session_info(session))
            if method == "DELETE":
                del self.sessions[sid]
                return self._deleted(sid)
        branches = session["branches"]
        if len(parts) == 2 and parts[1] == "branches":
            if method == "GET":
                return httpx.Response(200, json=[self._branch_info(b) for b in branches.values()])
            fork = contract.ForkRequest.model_validate(body or {})
            parent = branches.get(fork.parent)
            if parent is None:
                return self._error(404, f"branch {fork.parent!r} not found in session {sid!r}")
            bid = fork.branch_id or f"br_fake{next(self._ids)}"
            if bid in branches:
                return self._error(409, f"branch {bid!r} already exists")
            if fork.messages is not None:
                prefix = tokens(fork.messages)
                offset = 0
                for a, b in zip(parent["tokens"], prefix, strict=False):
                    if a != b:
                        break
                    offset += 1
            elif fork.token_offset is not None:
                offset = fork.token_offset
            else:
                offset = len(parent["tokens"])
            branches[bid] = self._branch(sid, bid, fork.parent, parent["tokens"][:offset], offset)
            return httpx.Response(201, json=self._branch_info(branches[bid]))
        bid = parts[2]
        branch = branches.get(bid)
        if branch is None:
            return self._error(404, f"branch {bid!r} not found in session {sid!r}")
        action = parts[3] if len(parts) > 3 else None
        if action is None and method == "GET":
            return httpx.Response(200, json=self._branch_info(branch))
        if action is None and method == "DELETE":
            del branches[bid]
            return self._deleted(bid)
        if action == "pin" and method == "POST":
            pin = contract.PinRequest.model_validate(body or {})
            branch["pinned"], branch["pin_ttl_s"] = True, pin.ttl_s
            return httpx.Response(200, json=self._branch_info(branch))
        if action == "pin" and method == "DELETE":
            branch["pinned"], branch["pin_ttl_s"] = False, None
            return httpx.Response(200, json=self._branch_info(branch))
        if action == "prefetch" and method == "POST":
            contract.PrefetchRequest.model_validate(body or {})
            self.stats["prefetches"] += 1
            n = len(branch["tokens"])
            result = contract.PrefetchResult(
                session_id=sid,
                branch_id=bid,
                num_tokens=n,
                status="scheduled" if n > 1 else "nothing_to_do",
            )
            return httpx.Response(202, json=result.model_dump(mode="json"))
        return httpx.Response(405, json={"detail": "Method Not Allowed"})

    def _chat(self, body: dict[str, Any]) -> httpx.Response:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return self._error(400, "messages must be a non-empty list")
        if body.get("model") != self.model:
            return self._error(404, f"The model `{body.get('model')}` does not exist.")
        reply = self.reply(messages)
        max_tokens = body.get("max_tokens")
        words = reply.content.split(" ") if reply.content else []
        finish = reply.finish_reason or ("tool_calls" if reply.tool_calls else "stop")
        if max_tokens is not None and len(words) > max_tokens:
            words, finish = words[:max_tokens], "length"
        content = " ".join(words)
        prompt = tokens(messages)
        split = None
        sid = body.get("session_id")
        cached = 0
        if sid and self.kvbranch:
            bid = (body.get("vllm_xargs") or {}).get(BRANCH_XARG) or DEFAULT_BRANCH
            session = self.sessions.get(sid) or self._session(sid)
            branch = session["branches"].setdefault(bid, self._branch(sid, bid))
            for a, b in zip(branch["tokens"], prompt, strict=False):
                if a != b:
                    break
                cached += 1
            cached = min(cached, len(prompt) - 1)
            answer = {"role": "assistant", "content": content}
            branch["tokens"] = prompt + tokens([answer])[1:]
            branch["requests"] += 1
            split = contract.PromptSourceSplit(
                session_id=sid,
                branch_id=bid,
                prompt_tokens=len(prompt),
                device_hit_tokens=cached,
                host_hit_tokens=0,
                remote_hit_tokens=0,
                recomputed_tokens=len(prompt) - cached,
            ).model_dump(mode="json")
            self.stats["device"] += cached
            self.stats["recomputed"] += len(prompt) - cached
        self.stats["requests"] += 1
        usage = {
            "prompt_tokens": len(prompt),
            "completion_tokens": len(words),
            "total_tokens": len(prompt) + len(words),
            "prompt_tokens_details": {"cached_tokens": cached},
        }
        cid = f"chatcmpl-fake{next(self._ids)}"
        if body.get("stream"):
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            chunks = stream_chunks(
                cid,
                self.model,
                content,
                reply.tool_calls,
                finish,
                usage if include_usage else None,
                split,
                self.stream_piece,
            )
            break_after, self._break_after = self._break_after, None
            return httpx.Response(
                200,
                headers={"content-type": "text/event-stream"},
                stream=EventStream(chunks, break_after),
            )
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if reply.tool_calls:
            message["tool_calls"] = [
                {
                    "id": tc.id,
                    "type": "function",
                    "function": {"name": tc.name, "arguments": tc.arguments},
                }
                for tc in reply.tool_calls
            ]
        data = {
            "id": cid,
            "object": "chat.completion",
            "model": self.model,
            "choices": [{"index": 0, "message": message, "finish_reason": finish}],
            "usage": usage,
        }
        if split is not None:
            data[RESPONSE_FIELD] = split
        return httpx.Response(200, json=data)
