"""The holder's side of a revive: a peer asks this aggregated replica to bring a branch's history
back from its host store into device blocks and hold them, then claims and pulls them as any
hold (:mod:`server.plugin.peer_pull` is the asking side; docs/cluster.md, "Holds").

``POST /v1/kvbranch/holds/revive`` with ``{"session_id", "branch_id"}``, signed with the cluster
secret (the guard answers 403 to anything else, :mod:`server.plugin.cluster_gate`) and with the
client's API key (the tenant: another tenant's key finds nothing). Before any engine work:

1. this replica's record of the branch's latest turn it served (:mod:`server.plugin.own_turns`;
   404 without one);
2. a slot: one revive per branch at a time, two in all (429 otherwise);
3. the host store's cover of the turn's prefix, from its block index, and the identity check
   (:mod:`server.plugin.revive_rules`; 409 when too little is covered or the identity differs).

A *block-run* revive (the body also names ``token_ids`` and ``cache_salt``:
:mod:`server.plugin.revive_rules`) is for a turn this replica has no record of; in place of 1
and 3: the salt must be the calling tenant's (403), and the host store's cover is of the
asked token ids, hashed here with that salt, each block's stored token ids compared (the
``run_coverage`` control op; 409 when too little is covered). Step 2 is the same.

Then one prefill of the covered prefix plus one token runs as an internal request of this
replica (:func:`server.connector.vllm_compat.prefill_only`) with the transfer params of a
session turn, so that the connector loads the blocks from the host store, computes one token
and holds the blocks as after a turn; its sealed handle is the answer (200
``{"handle": ...}``), or 503 when the engine gave none.

Where the prefill runs in this replica's scheduling: in vLLM's waiting queue as any request.
Under ``--agent-priority`` it is ranked as a resumed turn whose history is cached (level 0 at
its arrival: ahead of cold prefills that arrive after it, behind running requests, which vLLM
never preempts for it); with FCFS, behind whatever already waits. Its cost to this replica is
one computed token, the host-to-device copy of the prefix, and device blocks held until the
peer pulls them (a hold that yields to new work, as every hold does).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from array import array
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Body, Request
from fastapi.responses import JSONResponse, Response

from sdk.contract import BRANCH_XARG, OWNER_XARG, REMOTE_BLOCK_IDS, TRANSFER_PARAMS_FIELD
from server.common.errors import error_response
from server.common.priority_code import aging_from_env, encode
from server.common.tenants import scope_of
from server.connector.control.models import (
    HostCoverage,
    HostCoverageResult,
    RunCoverage,
    RunCoverageResult,
)
from server.connector.pd.transfer_auth import IDENTITY_FIELD
from server.index import Key
from server.plugin.own_turns import OwnTurn, OwnTurns, ReviveSlots
from server.plugin.revive_rules import (
    MAX_REVIVE_TOKENS,
    REVIVE_HANDLE_FIELD,
    REVIVE_PATH,
    Refusal,
    ReviveTarget,
    hashes_to_check,
    parse_target,
    revive_prompt,
    salt_refusal,
)
from server.plugin.tenancy import app_args_of, owner_of

logger = logging.getLogger("kvbranch.revive")

#: What a revive's request carries: no peer named; the connector holds its blocks when it ends.
REVIVE_TRANSFER_PARAMS: dict[str, Any] = {"do_remote_decode": False, "do_remote_prefill": False}
#: A revive's prefill may wait this long in the engine (then it is aborted: the peer recomputes).
REVIVE_TIMEOUT_S = 8.0

#: A control op's answer from one data-parallel engine's connector (``engine``: its rank).
Coverage = Callable[..., Awaitable[HostCoverageResult]]
RunCover = Callable[..., Awaitable[RunCoverageResult]]
#: (token ids, the turn, its key, the tenant's owner) -> the finished request's handle (run on
#: the turn's engine, ``own.engine``).
Prefill = Callable[[list[int], OwnTurn, Key, "str | None"], Awaitable["dict[str, Any] | None"]]


class Reviver:
    """This replica's record of its own turns, and the revives peers ask of it."""

    def __init__(
        self,
        coverage: Coverage,
        prefill: Prefill,
        *,
        block_size: int,
        min_tokens: int,
        max_tokens: int = MAX_REVIVE_TOKENS,
        turns: OwnTurns | None = None,
        slots: ReviveSlots | None = None,
        run_coverage: RunCover | None = None,
    ) -> None:
        self.coverage = coverage
        #: The host store's cover of a prompt's token ids (block-run revives; None: refused).
        self.run_coverage = run_coverage
        self.prefill = prefill
        self.block_size = block_size
        self.min_tokens = min_tokens
        self.max_tokens = max_tokens
        self.turns = turns or OwnTurns()
        self.slots = slots or ReviveSlots()
        #: Revives by outcome (``served`` or a refusal's reason), for ``/metrics``.
        self.outcomes: dict[str, int] = {}
        self.revived_tokens = 0

    def remember(self, key: Key, turn: int, cache_salt: Any, params: Any, engine: int = 0) -> None:
        """Keep the handle this replica's data-parallel engine ``engine`` issued for ``key``'s
        turn (what a revive needs)."""
        if isinstance(params, dict):
            own = OwnTurn.of(turn, cache_salt, params, engine)
            if own is not None:
                self.turns.remember(key, own)

    def _count(self, outcome: str) -> None:
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1

    async def revive(self, key: Key, owner: str | None) -> dict[str, Any] | Refusal:
        """The fresh sealed handle of ``key``'s branch, revived from the host store, or why
        not. Nothing runs in the engine unless every check passed."""
        result = await self._revive(key, owner)
        self._count(result.reason if isinstance(result, Refusal) else "served")
        return result

    async def revive_run(
        self, key: Key, owner: str | None, target: ReviveTarget, engine: int = 0
    ) -> dict[str, Any] | Refusal:
        """A block-run revive of ``target``'s token ids for ``key``'s turn on data-parallel
        engine ``engine`` (whose host store the index listed), or why not. Nothing runs in the
        engine unless every check passed."""
        result = await self._revive_run(key, owner, target, engine)
        self._count(result.reason if isinstance(result, Refusal) else "served")
        return result

    async def _revive_run(
        self, key: Key, owner: str | None, target: ReviveTarget, engine: int
    ) -> dict[str, Any] | Refusal:
        assert target.token_ids is not None
        refused = salt_refusal(target.cache_salt, owner)
        if refused is not None:
            return refused
        if self.run_coverage is None:
            return Refusal(404, "unknown", "this replica serves no block-run revives")
        tokens = target.token_ids[: self.max_tokens]
        busy = self.slots.take(key)
        if busy is not None:
            return Refusal(429, busy, "a revive of that branch (or too many) is running here")
        try:
            try:
                cover = await self.run_coverage(
                    RunCoverage(token_ids=tokens, cache_salt=target.cache_salt), engine=engine
                )
            except Exception as exc:  # noqa: BLE001 - the connector's answer, or none
                logger.info("kvbranch revive: run coverage failed (%s)", exc)
                return Refusal(503, "no_coverage", "the host store could not be asked: recompute")
            own = OwnTurn(
                0,
                target.cache_salt,
                cover.identity,
                list(cover.hashes),
                array("i", tokens),
                engine,
            )
            return await self._prefill(own, cover.blocks, key, owner, identity_ok=True)
        finally:
            self.slots.give(key)

    async def _revive(self, key: Key, owner: str | None) -> dict[str, Any] | Refusal:
        own = self.turns.get(key)
        if own is None:
            return Refusal(404, "unknown", "this replica holds no record of that branch's turns")
        busy = self.slots.take(key)
        if busy is not None:
            return Refusal(429, busy, "a revive of that branch (or too many) is running here")
        try:
            ask = HostCoverage(
                hashes=hashes_to_check(own.hashes, self.block_size, self.max_tokens),
                identity=own.identity,
                cache_salt=own.cache_salt,
                owner=owner,
            )
            try:
                cover = await self.coverage(ask, engine=own.engine)
            except Exception as exc:  # noqa: BLE001 - the connector's answer, or none
                logger.info("kvbranch revive: host coverage failed (%s)", exc)
                return Refusal(503, "no_coverage", "the host store could not be asked: recompute")
            return await self._prefill(own, cover.blocks, key, owner, cover.identity_ok)
        finally:
            self.slots.give(key)

    async def _prefill(
        self, own: OwnTurn, blocks: int, key: Key, owner: str | None, identity_ok: bool
    ) -> dict[str, Any] | Refusal:
        """The covered blocks plus one token through the engine, once the cover allows it."""
        prompt = revive_prompt(
            own.tokens,
            blocks,
            self.block_size,
            identity_ok=identity_ok,
            min_tokens=self.min_tokens,
            max_tokens=self.max_tokens,
        )
        if isinstance(prompt, Refusal):
            return prompt
        try:
            handle = await asyncio.wait_for(self.prefill(prompt, own, key, owner), REVIVE_TIMEOUT_S)
        except TimeoutError:
            return Refusal(503, "timeout", "the revive did not run in time: recompute")
        except Exception as exc:  # noqa: BLE001 - the engine refused or failed it
            logger.info("kvbranch revive: the prefill failed (%s)", exc)
            return Refusal(503, "failed", "the revive's request failed: recompute")
        if (
            not isinstance(handle, dict)
            or not handle.get(REMOTE_BLOCK_IDS)
            or handle.get(IDENTITY_FIELD) != own.identity
        ):
            return Refusal(503, "no_hold", "the revive's request left no hold: recompute")
        self.revived_tokens += len(prompt) - 1
        return handle

    def counters(self) -> dict[str, Any]:
        return {
            "outcomes": dict(self.outcomes),
            "revived_tokens": self.revived_tokens,
            "remembered": len(self.turns),
        }


def revive_priority(clock: Callable[[], float] = time.monotonic) -> int:
    """vLLM priority of a revive: a resumed, cached turn's (level 0 at its arrival) under
    ``--agent-priority``; 0 under FCFS, where vLLM ignores it."""
    return encode(clock(), 0) if aging_from_env() is not None else 0


def engine_prefill(engine_client: Any, engines: int = 1) -> Prefill:
    """The revive's request on this replica's own engine (of ``engines`` data-parallel ones:
    the turn's, ``own.engine``)."""

    async def run(tokens: list[int], own: OwnTurn, key: Key, owner: str | None) -> Any:
        from server.connector.vllm_compat import prefill_only

        extra: dict[str, Any] = {
            TRANSFER_PARAMS_FIELD: dict(REVIVE_TRANSFER_PARAMS),
            BRANCH_XARG: key[2],
        }
        if owner:
            extra[OWNER_XARG] = owner
        return await prefill_only(
            engine_client,
            tokens,
            request_id=f"kvbranch-revive-{uuid.uuid4().hex}",
            cache_salt=own.cache_salt,
            extra_args=extra,
            session_id=key[1],
            priority=revive_priority(),
            data_parallel_rank=own.engine if engines > 1 else None,
        )

    return run


def control_coverage(controls: Any) -> Any:
    """A control op's answer (``host_coverage``, ``run_coverage``) from the connector of
    data-parallel engine ``engine`` (``controls``: one control client per engine, or one)."""
    clients = list(controls) if isinstance(controls, (list, tuple)) else [controls]

    async def ask(req: Any, engine: int = 0) -> Any:
        return await clients[engine].call(req)

    return ask


router = APIRouter(tags=["kvbranch"])


@router.post(REVIVE_PATH)
async def revive_branch(request: Request, body: Any = Body(...)) -> Response:  # noqa: B008
    kvb = request.app.state.kvbranch
    reviver = getattr(getattr(kvb, "peer_pulls", None), "reviver", None)
    if not isinstance(reviver, Reviver):
        return error_response(404, "this instance is not an aggregated replica with peer pulls")
    target = parse_target(body)
    if isinstance(target, Refusal):
        return error_response(target.status, target.message)
    authorization = request.headers.get("authorization")
    key = (scope_of(authorization), target.session_id, target.branch_id)
    owner = owner_of(authorization, app_args_of(request.app))
    if target.token_ids is None:
        result = await reviver.revive(key, owner)
    else:
        engine = kvb.peer_pulls.engine_of_member(target.member)
        if engine is None:
            return error_response(404, "no engine of this replica is that member")
        result = await reviver.revive_run(key, owner, target, engine)
    if isinstance(result, Refusal):
        return error_response(result.status, result.message)
    return JSONResponse({REVIVE_HANDLE_FIELD: result})
