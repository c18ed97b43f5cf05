"""The router's non-completion routes: kvbranch session routes, stats, health, models.

Session routes (``/v1/kvbranch/...``) go to the instances that have the session (each keeps its
own pins and host store). With the embedded index that is every instance. With a shared index
(instances heartbeat there) it is the instances the index records for the session — its home P
and the instances its turns ran on — and a new session is created on the P its first turn will
go to (instances a later turn reaches create it lazily): a create or pin costs a few requests,
not one per instance in the cluster. In front of aggregated replicas the replicas take the
prefill instances' part (:attr:`server.router.pool.Pool.front`). Reads go to a prefill instance
that has it; ``stats`` adds
the cluster index. A fan-out never answers with just the first instance's reply: all must
agree, or the client gets 502 with each instance's status, and a retry with the same id
converges (an instance that already has the session counts as created, one that no longer has it
as deleted). A delete and a fork are the exceptions for instances that cannot be reached. A
delete succeeds for the ones that answer (200, or 202 when none of them had it), names the
unreachable ones, drops the session's index entries so no turn or peer is sent to its KV, and
the router sends each unreachable instance the delete again before it counts it as up
(:mod:`server.router.pending_deletes`). A fork that every reachable instance made succeeds and
names the unreachable ones: an instance makes a branch at its first turn there anyway.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from typing import Any, Literal

import httpx
from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from sdk.contract import (
    ALREADY_EXISTS,
    API_PREFIX,
    PROTOCOL_VERSION,
    STATS_PATH,
    ClusterInfo,
    RouterHealthInfo,
    check_id,
    error_body,
)
from server.common.errors import error_response
from server.common.ui_page import UI_DATA_PATH
from server.connector.core.sessions import new_id
from server.index import IndexUnavailable, SessionStore
from server.router import relay
from server.router.edge import (
    SESSION_ROUTE_HEADERS,
    Refused,
    read_session_body,
    tenant_of,
    unavailable,
)
from server.router.fork_hold import share_parent_hold
from server.router.pending_deletes import MissedDelete, PendingDeletes
from server.router.pool import Instance, Pool

logger = logging.getLogger("kvbranch.router")


FanKind = Literal["create", "delete", "other"]


@dataclass
class Answer:
    """One instance's reply to a fanned-out session route (``status`` None: no reply)."""

    inst: Instance
    status: int | None
    content: bytes = b""
    content_type: str | None = None
    error: str | None = None

    def message(self) -> str:
        if self.error is not None:
            return self.error
        try:
            return str(json.loads(self.content)["error"]["message"])[:200]
        except (ValueError, KeyError, TypeError):
            return self.content[:200].decode(errors="replace")


#: The session routes a client may send through the router (method, path under
#: ``/v1/kvbranch/``; ``{id}`` is a session or branch id): exactly the instances' own session
#: routes (a unit test compares them with the plugin's route table). Anything else — the hold
#: claim, dot segments, encoded or not, any other path — is 404 here and never forwarded.
SESSION_ROUTES = frozenset(
    {
        ("POST", "sessions"),
        ("GET", "sessions/{id}"),
        ("DELETE", "sessions/{id}"),
        ("GET", "sessions/{id}/branches"),
        ("POST", "sessions/{id}/branches"),
        ("GET", "sessions/{id}/branches/{id}"),
        ("DELETE", "sessions/{id}/branches/{id}"),
        ("POST", "sessions/{id}/branches/{id}/pin"),
        ("DELETE", "sessions/{id}/branches/{id}/pin"),
        ("POST", "sessions/{id}/branches/{id}/prefetch"),
    }
)


def route_shape(path: str) -> str | None:
    """``path`` (as the client's request decoded it) with its ids replaced by ``{id}``, or None
    when a segment in an id's place is not an id (``..``, ``%2e%2e``, an empty segment...)."""
    parts = path.split("/")
    for i in (1, 3):
        if len(parts) > i:
            try:
                check_id(parts[i])
            except ValueError:
                return None
            parts[i] = "{id}"
    return "/".join(parts)


def known_route(method: str, path: str) -> bool:
    shape = route_shape(path)
    return shape is not None and (method, shape) in SESSION_ROUTES


def fan_kind(method: str, path: str) -> FanKind:
    parts = path.split("/")
    if method == "POST" and (path == "sessions" or (len(parts) == 3 and parts[2] == "branches")):
        return "create"
    if method == "DELETE" and len(parts) in (2, 4) and parts[0] == "sessions":
        return "delete"
    return "other"


def already_done(kind: FanKind, answer: Answer) -> bool:
    """A retry's answer meaning "this instance already did it": the create found the id
    there, the delete found it gone — so a retry after a partial failure converges."""
    if kind == "create":
        return answer.status == 409 and ALREADY_EXISTS in answer.message()
    if kind == "delete":
        return answer.status == 404
    return False


def merge(kind: FanKind, answers: list[Answer], body: bytes | None) -> Response:
    """One reply for a fan-out: the instances' common answer when they agree (an
    "already done" counts as done), else 502 naming each instance and its status."""
    ok = [a for a in answers if a.status is not None and 200 <= a.status < 300]
    failed = [a for a in answers if not any(a is o for o in ok) and not already_done(kind, a)]
    if not failed or (
        not ok
        and len({a.status for a in answers}) == 1
        and answers[0].status is not None
        and answers[0].status < 500
    ):
        # all done, or all refused alike (the client's own error, e.g. 404 or 400)
        best = ok[0] if ok else answers[0]
        return Response(best.content, status_code=best.status or 502, media_type=best.content_type)
    names = "; ".join(
        f"{a.inst.role} {a.inst.url} "
        f"{'unreachable' if a.status is None else f'answered {a.status}'}: "
        f"{a.message()}"
        for a in failed
    )
    message = (
        f"{len(failed)} of {len(answers)} instances failed ({names}); "
        "the others applied it — retry the same request (same id) to converge"
    )
    data: dict[str, Any] = error_body(502, message)
    data["instances"] = [
        {
            "url": a.inst.url,
            "role": a.inst.role,
            "status": a.status,
            "ok": not any(a is f for f in failed),
            **({} if not any(a is f for f in failed) else {"error": a.message()}),
        }
        for a in answers
    ]
    try:
        sent = json.loads(body) if body else None
    except ValueError:
        sent = None
    if isinstance(sent, dict):  # the id the router chose, so the retry can name it
        data.update({k: sent[k] for k in ("session_id", "branch_id") if sent.get(k)})
    return JSONResponse(data, status_code=502)


def merge_unreachable(kind: FanKind, answers: list[Answer], target: str) -> Response | None:
    """One reply for a delete or a fork that some instances could not be reached for, when
    every instance that answered applied it (or had already): what they answered, with the
    unreachable instances named, never a 5xx for those. None where the plain fan-out's answer
    stands: every instance answered, or one that answered did not apply it (a 500, a refusal).
    A delete reaches the missed instances later (:mod:`server.router.pending_deletes`); a fork
    needs nothing there, since an instance makes a branch it does not know at the branch's first
    turn, and the branch's turns find the KV through the hold it shares with its parent."""
    unreachable = [a for a in answers if a.status is None]
    reached = [a for a in answers if a.status is not None]
    if (
        not unreachable
        or (kind != "delete" and not reached)  # a fork nothing made
        or any(not (200 <= (a.status or 0) < 300 or already_done(kind, a)) for a in reached)
    ):
        return None
    missed = [{"url": a.inst.url, "role": a.inst.role} for a in unreachable]
    for a in reached:
        if a.status is not None and 200 <= a.status < 300:
            try:
                data = json.loads(a.content)
            except ValueError:
                data = None
            if isinstance(data, dict):
                return JSONResponse({**data, "unreachable": missed}, status_code=a.status)
    if kind == "delete":  # none that answered had it (an unreachable one may have)
        return JSONResponse(
            {"deleted": target, "released_blocks": 0, "unreachable": missed}, status_code=202
        )
    return merge(kind, reached, None)  # a retried fork every reached instance already has


def with_id(body: bytes, field: str, prefix: str) -> bytes:
    """``body`` with ``field`` set to a new id when the client left it out: every instance
    must create the same id."""
    try:
        data = json.loads(body) if body else {}
    except ValueError:
        return body  # the instances answer with their own 400
    if isinstance(data, dict) and not data.get(field):
        data[field] = new_id(prefix)
        return json.dumps(data).encode()
    return body


class Admin:
    """Session routes, stats, health and model listing across the pool."""

    def __init__(self, pool: Pool, index: SessionStore, fanout_timeout_s: float = 60.0) -> None:
        self.pool = pool
        self.index = index
        self.fanout_timeout_s = fanout_timeout_s
        self.pending = PendingDeletes()
        pool.before_up = self.deliver_missed

    async def front(self) -> tuple[list[Instance], str]:
        """The live instances a session's reads and creates go to, and what to call them: the
        prefill instances, or the replicas in aggregated mode (membership read first: which
        mode the router is in depends on it)."""
        await self.pool.refresh_members()
        noun = "replica" if self.pool.aggregated else "prefill instance"
        return await self.pool.live(self.pool.front), noun

    async def forward(
        self,
        request: Request,
        inst: Instance,
        path: str,
        body: bytes | None,
        timeout: float | None = None,
    ) -> httpx.Response:
        headers = {k: v for k, v in request.headers.items() if k.lower() in SESSION_ROUTE_HEADERS}
        extra: dict[str, Any] = {} if timeout is None else {"timeout": timeout}
        return await self.pool.client.request(
            request.method,
            inst.url + path,
            content=body,
            headers=headers,
            **extra,
        )

    async def _fan_one(
        self,
        request: Request,
        inst: Instance,
        path: str,
        body: bytes | None,
        *,
        keep_missed: bool = False,
    ) -> Answer:
        try:
            r = await self.forward(request, inst, path, body, timeout=self.fanout_timeout_s)
        except httpx.HTTPError as exc:
            if keep_missed:  # before it is marked down: its next probe sends it this delete
                headers = {k: v for k, v in request.headers.items() if k.lower() == "authorization"}
                self.pending.add(inst.url, tenant_of(request), path, headers)
            self.pool.mark_down(inst)
            return Answer(inst, None, error=f"{type(exc).__name__}: {exc}"[:200])
        return Answer(inst, r.status_code, r.content, r.headers.get("content-type"))

    async def deliver_missed(self, inst: Instance) -> bool:
        """Before ``inst`` counts as up again: the deletes it missed while unreachable."""
        return await self.pending.deliver(inst.url, self._send_missed)

    async def _send_missed(self, url: str, missed: MissedDelete) -> int | None:
        try:
            r = await self.pool.probe_client.delete(url + missed.path, headers=missed.headers)
        except httpx.HTTPError:
            return None
        return r.status_code

    async def session_route(self, request: Request, path: str) -> Response:
        if not known_route(request.method, path):
            return error_response(
                404, f"no kvbranch route {request.method} {API_PREFIX}/{path[:200]}"
            )
        try:
            body = await read_session_body(request)
        except Refused as refused:
            return refused.response
        prefills, noun = await self.front()
        if not prefills:
            return unavailable(f"no {noun} is reachable")
        tenant = tenant_of(request)
        full = f"{API_PREFIX}/{path}"
        if request.method == "POST" and (path == "sessions" or path.endswith("/branches")):
            # Every instance must create the same id: choose it here when the client did not.
            body = with_id(
                body,
                "session_id" if path == "sessions" else "branch_id",
                "sess" if path == "sessions" else "br",
            )
        placed = await self.placement(tenant, path, body)
        if path.endswith("/prefetch") or request.method == "GET":
            if path.endswith("/prefetch"):  # warms the session's own prefill instance
                parts = path.split("/")
                chosen = await self.pool.choose_front(
                    (tenant, parts[1], parts[3]) if len(parts) > 3 else None
                )
                targets = [chosen or prefills[0]]
            else:  # a read: an instance that has the session; the first that answers
                live_placed = [i for i in prefills if placed is None or i in placed]
                targets = live_placed + [i for i in prefills if i not in live_placed]
            return await self.first_answer(
                request, targets, full, body or None, f"no {noun} answered"
            )
        # A change: every instance that has the session, the ones seen down included — the
        # answer must say which instance missed it, and a retry must reach it.
        fan = self.pool.all if placed is None else placed
        kind = fan_kind(request.method, path)
        answers = await asyncio.gather(
            *(
                self._fan_one(request, t, full, body or None, keep_missed=kind == "delete")
                for t in fan
            )
        )
        if (
            kind == "delete"
            and path.count("/") == 1
            and (
                any(a.status == 200 or already_done(kind, a) for a in answers)
                or all(a.status is None for a in answers)
            )
        ):
            # Holds, home and placement go even when an instance that has the session could not
            # be reached: no turn is sent to its KV and no peer pulls or revives it from there.
            try:
                await self.index.drop_session(tenant, path.split("/")[1])
            except IndexUnavailable:
                pass  # its holds expire on their own; a claim on D then finds nothing
        fork = kind == "create" and path.endswith("/branches")
        merged = None
        if kind == "delete" or fork:
            merged = merge_unreachable(kind, answers, path.split("/")[-1])
        if merged is None:
            merged = merge(kind, answers, body)
        if fork and merged.status_code < 300:
            await share_parent_hold(self.index, tenant, path.split("/")[1], body)
        return merged

    async def placement(self, tenant: str, path: str, body: bytes) -> list[Instance] | None:
        """The instances a session route goes to, with a shared index; None: every instance
        (the embedded index, or the shared one unreachable — then every instance is the safe
        answer). A new session goes to the P its first turn will go to, recorded as its home."""
        if not any(i.record is not None for i in self.pool.all):
            return None
        parts = path.split("/")
        try:
            if path == "sessions":
                try:
                    session = json.loads(body).get("session_id") if body else None
                except (ValueError, AttributeError):
                    return None  # the instances answer with their own 400
                if not isinstance(session, str):
                    return None
                home = await self.pool.choose_front((tenant, session, "main"))
                if home is None or home.instance_id is None:
                    return None
                await self.index.set_home(tenant, session, home.instance_id)
                await self.index.add_session_instances(tenant, session, [home.instance_id])
                return [home]
            iids = await self.index.session_instances(tenant, parts[1])
        except IndexUnavailable:
            return None
        placed = [i for i in self.pool.all if i.instance_id in iids]
        return placed or None

    async def stats(self, request: Request) -> Response:
        prefills, noun = await self.front()
        if not prefills:
            return unavailable(f"no {noun} is reachable")
        r = await self.forward(request, prefills[0], STATS_PATH, None)
        if r.status_code != 200:
            return relay.passthrough(r)
        data = r.json()
        tenant = tenant_of(request)
        cluster = ClusterInfo.model_validate(
            {
                "instances": self.pool.infos(),
                "index": await self.index.snapshot(tenant),
                "index_counters": self.index.counters(),
                "hold_ttl_s": self.index.hold_ttl_s,
            }
        )
        data["cluster"] = cluster.model_dump()
        return JSONResponse(data)

    async def ui_data(self, request: Request) -> Response:
        """The agent page's data (``/kvbranch/ui``) through the router: the sessions as a
        prefill instance lists them for the caller's key (as :meth:`stats` does), with the
        last turns of their branches from every live instance (a P/D turn is recorded where
        it ran), each naming the instance's role. The key goes to the instances as the
        client sent it: each answers for that key's tenant only."""
        prefills, noun = await self.front()
        if not prefills:
            return unavailable(f"no {noun} is reachable")
        others = [i for i in await self.pool.live(self.pool.decodes) if i not in prefills]
        answers = await asyncio.gather(
            *(self._fan_one(request, inst, UI_DATA_PATH, None) for inst in prefills + others)
        )
        first = answers[0]
        if first.status != 200:
            return merge("other", [first], None)
        try:
            data = json.loads(first.content)
            sessions = data["sessions"]
            listed = {(s["session_id"], b["branch_id"]) for s in sessions for b in s["branches"]}
        except (ValueError, KeyError, TypeError):
            return error_response(502, f"{first.inst.url} answered the page's data unreadably")
        turns = []
        for answer in answers:
            if answer.status != 200:
                continue
            try:
                theirs = json.loads(answer.content)["turns"]
                turns += [
                    dict(t, instance=answer.inst.role)
                    for t in theirs
                    if (t["session_id"], t["branch_id"]) in listed
                ]
            except (ValueError, KeyError, TypeError):
                logger.warning("%s answered the page's data unreadably", answer.inst.url)
        turns.sort(key=lambda t: t.get("at") or 0)
        data.update(turns=turns, role="router")
        return JSONResponse(data, headers={"Cache-Control": "no-store"})

    async def health(self) -> Response:
        """A prefill instance's health (the sdk reads it) plus the router's view of all (the
        shared index's members included: a router given no URL knows its instances only from
        there, and would answer 503 with none listed until a turn happened to refresh them)."""
        pool = self.pool
        await pool.refresh_members()
        await pool.probe_all()
        ok = pool.routable(pool.front) and (pool.aggregated or pool.routable(pool.decodes))
        # A live prefill instance's health as the probe just read it (no request of its own:
        # a /health flood costs the instances at most the probes' one per instance per second).
        body = next((dict(i.health) for i in pool.front if i.alive and i.health), {})
        view = {
            "status": "ok" if ok else "degraded",
            "role": "router",
            "protocol_version": PROTOCOL_VERSION,
            "instances": pool.infos(),
        }
        try:
            health = RouterHealthInfo.model_validate({**body, **view})
        except ValidationError as exc:  # a prefill instance that speaks another contract
            logger.warning("prefill health does not match the contract: %s", exc)
            health = RouterHealthInfo.model_validate(view)
        serving = pool.routable(pool.all)  # fallbacks still serve
        return JSONResponse(
            health.model_dump(exclude_unset=True), status_code=200 if serving else 503
        )

    async def passthrough_get(self, request: Request, path: str) -> Response:
        live = await self.pool.live(self.pool.prefills) + await self.pool.live(self.pool.decodes)
        live += await self.pool.live(self.pool.replicas)
        return await self.first_answer(request, live, path, None, "no instance is reachable")

    async def first_answer(
        self,
        request: Request,
        targets: list[Instance],
        path: str,
        body: bytes | None,
        none_message: str,
    ) -> Response:
        """The first of ``targets`` that answers, as it answered; an instance that cannot be
        reached is marked down and the next one tried; 503 when none answers."""
        for inst in targets:
            try:
                r = await self.forward(request, inst, path, body)
            except httpx.HTTPError:
                self.pool.mark_down(inst)
                continue
            return relay.passthrough(r)
        return unavailable(none_message)
