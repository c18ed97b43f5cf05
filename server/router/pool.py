"""The router's instance pool: which prefill and decode instances are up, and which one a turn
goes to.

Health is probed lazily (at most once per ``PROBE_MAX_AGE_S`` per instance, when a turn needs
it) and an instance that could not be reached is marked down at once; it comes back on the next
probe that answers 200. Each probe also reads the instance's ``instance_id``: a changed id means
the instance restarted and lost the blocks it held, so ``on_restart`` drops its index entries.

Ejection (a circuit breaker, as vllm-router has one): an instance whose health check answers
but whose requests fail (unreachable or 5xx) ``EJECT_AFTER_FAILURES`` times in a row is left out
for ``EJECT_S`` whatever its health check says; then it gets one request again, and one more
failure ejects it again. A success resets the count. Without this, every turn would pay a
failed leg on it before falling back.

Choice: a session's turns (and its forks) go to the same prefill instance — where its local
prefix cache and host store are — by rendezvous hashing of (tenant, session) over the live
prefill instances: when one leaves, only its own sessions move (spread over the others), and
when it comes back they return — the others' sessions keep their instance and its cache. A turn
without a session goes to the least busy one. A decode instance is the one that holds the
branch's KV when it is up, else the least busy.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

from sdk.contract import HEALTH_PATH, InstanceInfo
from server.cluster_auth import ROUTER_PROOF_HEADER, sign
from server.connector.pd.transfer_auth import load_cluster_secret
from server.router.index import Key

logger = logging.getLogger("kvbranch.router")

PROBE_MAX_AGE_S = 1.0
PROBE_TIMEOUT_S = 3.0
#: Failed requests in a row (unreachable or 5xx) after which an instance is left out ...
EJECT_AFTER_FAILURES = 3
#: ... for this long, whatever its health check says (vllm-router's breaker waits 30 s too).
EJECT_S = 30.0


@dataclass
class Instance:
    url: str
    role: str
    alive: bool = False
    instance_id: str | None = None
    checked_at: float = 0.0
    inflight: int = 0
    requests: int = 0
    failures: int = 0
    #: Failed requests in a row; a success resets it.
    consecutive_failures: int = 0
    #: Left out until then (router clock), see ``EJECT_S``.
    ejected_until: float = 0.0

    def info(self) -> dict[str, Any]:
        """As health and stats report it (:class:`InstanceInfo`)."""
        return InstanceInfo(
            url=self.url,
            role=self.role,
            alive=self.alive,
            instance_id=self.instance_id,
            inflight=self.inflight,
            requests=self.requests,
            failures=self.failures,
        ).model_dump()


class Pool:
    """The instances, their health, and the one HTTP client the router talks to them with."""

    def __init__(
        self,
        prefill_urls: list[str],
        decode_urls: list[str],
        *,
        client: httpx.AsyncClient,
        api_key: str | None = None,
        on_restart: Callable[[str], int] | None = None,
        secret: bytes | None = None,
    ) -> None:
        if not prefill_urls or not decode_urls:
            raise ValueError("a router needs at least one prefill and one decode instance")
        self.prefills = [Instance(u.rstrip("/"), "prefill") for u in prefill_urls]
        self.decodes = [Instance(u.rstrip("/"), "decode") for u in decode_urls]
        self.client = client
        self.api_key = api_key
        self._on_restart = on_restart
        #: The cluster secret: it signs the requests that carry transfer params or claims.
        self.secret = secret if secret is not None else load_cluster_secret()

    @property
    def all(self) -> list[Instance]:
        return self.prefills + self.decodes

    def infos(self) -> list[dict[str, Any]]:
        return [i.info() for i in self.all]

    def auth_headers(self) -> dict[str, str]:
        """The router's own key, for the calls it makes itself (probes, claims)."""
        return {"authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def proof(self, method: str, path: str, content: bytes) -> dict[str, str]:
        """The header that tells an instance this request is the router's own
        (:mod:`server.cluster_auth`): the only way transfer params or a claim are accepted."""
        return {ROUTER_PROOF_HEADER: sign(self.secret, method, path, content)}

    async def probe(self, inst: Instance, max_age: float = PROBE_MAX_AGE_S) -> bool:
        now = time.monotonic()
        if now < inst.ejected_until:
            return False
        if now - inst.checked_at < max_age:
            return inst.alive
        try:
            r = await self.client.get(
                inst.url + HEALTH_PATH, headers=self.auth_headers(), timeout=PROBE_TIMEOUT_S
            )
            alive = r.status_code == 200
            reported = r.json().get("instance_id") if alive else inst.instance_id
        except (httpx.HTTPError, ValueError):
            alive, reported = False, inst.instance_id
        if alive and inst.instance_id and reported != inst.instance_id:
            dropped = self._on_restart(inst.url) if self._on_restart else 0
            logger.warning(
                "%s %s restarted; dropped %d index entries", inst.role, inst.url, dropped
            )  # a restart lost D's blocks
        if alive != inst.alive:
            logger.warning("%s %s is %s", inst.role, inst.url, "up" if alive else "DOWN")
        inst.alive, inst.instance_id, inst.checked_at = alive, reported, time.monotonic()
        return alive

    def mark_down(self, inst: Instance) -> None:
        """``inst`` could not be reached: skip it until a probe finds it up again."""
        inst.alive, inst.checked_at = False, time.monotonic()
        inst.failures += 1

    def failed(self, inst: Instance, *, reachable: bool = True) -> None:
        """A turn's request to ``inst`` failed (5xx, or unreachable: then it is also marked
        down); enough in a row eject it. Only turns count: a session route fanned out to an
        instance that is down anyway must not keep it out once it is back."""
        if reachable:
            inst.failures += 1
        else:
            self.mark_down(inst)
        inst.consecutive_failures += 1
        if inst.consecutive_failures >= EJECT_AFTER_FAILURES:
            inst.alive, inst.ejected_until = False, time.monotonic() + EJECT_S
            logger.warning(
                "%s %s failed %d requests in a row: left out for %.0f s",
                inst.role,
                inst.url,
                inst.consecutive_failures,
                EJECT_S,
            )

    def succeeded(self, inst: Instance) -> None:
        """A request to ``inst`` was answered (any status under 500)."""
        inst.consecutive_failures = 0

    async def probe_all(self) -> None:
        await asyncio.gather(*(self.probe(i, 0.0) for i in self.all))

    async def live(self, instances: list[Instance]) -> list[Instance]:
        alive = await asyncio.gather(*(self.probe(i) for i in instances))
        return [i for i, ok in zip(instances, alive, strict=True) if ok]

    async def choose_prefill(self, key: Key | None) -> Instance | None:
        """Session affinity: a session's turns (and forks) go to the same P, where its local
        prefix cache and host store are."""
        live = await self.live(self.prefills)
        if not live:
            return None
        if key is None:
            return min(live, key=lambda i: i.inflight)
        session = f"{key[0]}/{key[1]}\0".encode()
        return max(live, key=lambda i: _weight(session, i.url))

    async def choose_decode(self, held_on: str | None) -> Instance | None:
        live = await self.live(self.decodes)
        if not live:
            return None
        for inst in live:
            if inst.url == held_on:
                return inst  # the D that holds this branch's KV
        return min(live, key=lambda i: i.inflight)


def _weight(session: bytes, url: str) -> int:
    """Rendezvous (highest random weight) hashing: each (session, instance) pair gets a stable
    pseudo-random weight; a session goes to its heaviest live instance."""
    return int.from_bytes(hashlib.blake2b(session + url.encode(), digest_size=8).digest(), "big")
