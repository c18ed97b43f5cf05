"""Aggregated replicas: a session's turn pulls its history from the replica that holds it.

An instance started with ``--role single --index URL`` (docs/cluster.md, "Aggregated
replicas") runs the P/D connector stack as both sides at once. Behind any balancer — a
Kubernetes Service, llm-d's scheduler, our router — each session turn it receives goes through
:class:`PeerPulls`:

1. **begin** (before vLLM reads the request): take the branch's hold from the index
   (:meth:`~server.index.sessions.SessionStore.begin_turn`, atomic and single-use across the
   cluster). When another member holds the branch, claim that hold on it (``HOLD_CLAIM_PATH``,
   signed with the cluster secret, as the P/D router claims D's) and hand the claimed handle to
   this instance's connector, which checks it like every P/D handle (seal, claim, identity,
   token prefix, chained block hashes) and pulls only the verified prefix over NIXL. The peer is
   found by the hold's instance id among the **sealed** member records, and its NIXL side
   channel must be the one the handle (sealed by the peer) names: nothing a client sends
   chooses whether a pull happens or where it goes.
   When the index offers no hold (its offer ended) but names another member as the session's
   home (where its last turn was served), or the holder answers that its hold has ended
   (410: the blocks went to new work), ask that member to **revive** the branch
   (``REVIVE_PATH``, signed the same way; :mod:`server.plugin.revive` is the other side): it
   loads the prefix its host store still has into device blocks and answers with a fresh
   sealed handle, which is claimed and pulled as above.
   When there is no home to ask, or it refused (a fork's new branch has no record on it), ask
   the member whose host store the index says holds the longest run of the prompt's blocks
   for a *block-run* revive of the prompt's token ids up to that run's end
   (:mod:`server.plugin.run_lookup`), claimed and pulled the same way.
   Before each claim and each revive, :class:`~server.plugin.pull_cost.PullCostModel` decides
   whether the pull beats recomputing: the tokens it would bring (the sealed handle's, the
   branch's last chain in the index, or the run's beyond this replica's own host store), the
   peer's load (its sealed record) and the speeds this replica measured (:meth:`PeerPulls.
   observe`, from each finished turn's split and time to first token).
2. **file** (when the answer is complete): this instance's own sealed handle for the turn it
   just served (the connector holds the blocks as a D does) goes into the index for the
   branch's next turn, wherever that lands, and this instance becomes the session's home; the
   client never sees it. The handle is also kept here, for a peer's revive. When the branch
   was pinned on the member that served it before (its hold's issuer, else the session's
   home), the pin follows it here for what was left of its lease (:mod:`server.common.
   pin_follow`, with the client's own key): a plain front moves a session without telling
   anyone, so the replica it lands on carries the pin over, as our router does for the turns
   it moves.

With several data-parallel engines each engine is a member of its own (its connector, host
store and NIXL side channel; :func:`~server.index.membership.member_id`): a session's turn is
the member of the engine the plugin gives the session (the digest of its owner and id), whose
hold it files and whose holds count as its own; a peer's claim reaches the engine whose side
channel the handle names (:mod:`server.plugin.holds`), its revive the engine that served the
turn, its block-run revive the member it names.

Anything that fails — the index, the peer, the claim, the pull itself — costs a recompute,
never the request.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import httpx

from sdk.contract import (
    CACHE_SALT_FIELD,
    CLAIM_FIELD,
    COMPLETION_PATHS,
    HOLD_CLAIM_PATH,
    REMOTE_BLOCK_IDS,
    HoldClaimRequest,
    HoldClaimResult,
)
from server.common.cluster_auth import ROUTER_PROOF_HEADER, sign
from server.common.pin_follow import follow_pin
from server.index import Hold, InstanceRecord, Key, member_id, record_seal
from server.plugin.pull_cost import MIN_PULL_TOKENS, PullCostModel, PullPath
from server.plugin.revive_rules import REVIVE_HANDLE_FIELD, REVIVE_PATH

if TYPE_CHECKING:
    from server.plugin.revive import Reviver
    from server.plugin.run_lookup import RunFound, RunLookup

logger = logging.getLogger("kvbranch.peer_pull")

#: What a session turn that pulls nothing carries: no peer named, yet the connector holds the
#: turn's blocks when it ends (a D's turn in upstream's bidirectional mode).
LOCAL_PARAMS: dict[str, Any] = {"do_remote_decode": False, "do_remote_prefill": False}
#: The routes whose requests carry transfer params in vLLM 0.32 (chat, completions, Anthropic).
PEER_PULL_PATHS = (*COMPLETION_PATHS, "/v1/messages")
#: One index call may take this long; past it the turn goes on without the index.
INDEX_TIMEOUT_S = 1.0
CLAIM_TIMEOUT_S = 2.0
#: A revive waits for the holder's one-token prefill (it gives up after its own 8 s).
REVIVE_WAIT_S = 10.0
#: How long a read of the member list is reused (heartbeats come every 2 s).
MEMBERS_TTL_S = 1.0
#: Where a turn's history came from (its ``source``) -> the pull path the cost model measures.
PATH_OF_SOURCE: dict[str, PullPath] = {"peer": "hold", "revived": "revive", "revived_run": "run"}


@dataclass
class PeerTurn:
    """One session turn on this replica: its index key and turn number, and where its history
    was to come from (``local``: this instance's own caches; ``peer``: a claimed pull)."""

    key: Key
    turn: int
    source: str = "local"
    #: The data-parallel engine serving it (its member id: :meth:`PeerPulls.member_of`).
    engine: int = 0
    #: The request's cache salt (the tenant's), kept with this replica's handle for revives.
    cache_salt: Any = None
    #: When the turn began here and when its first token went out (``time.monotonic``; the
    #: middleware sets the second on a stream's first event), for the cost model's speeds.
    started_at: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    #: The peer's load the pull was decided with (its wait is not the link's).
    peer_load: int = 0
    #: The member that served the branch before (the hold's issuer, else the session's home):
    #: its pin of the branch follows the branch here once the turn is answered. None: this one.
    left: str | None = None
    #: The client's ``Authorization``, for that pin's read and write (the tenant's own rights).
    authorization: str | None = field(default=None, repr=False)
    #: The tokens the claimed hold offers (0: nothing pulled): the request's priority counts
    #: them as cached (:meth:`server.plugin.priority.PriorityPolicy.assign`).
    held_tokens: int = 0


@dataclass
class PeerCounts:
    """What this replica did, for ``/metrics``."""

    turns: int = 0
    pulls_claimed: int = 0
    pulled_hold_tokens: int = 0
    claims_refused: int = 0
    peers_unknown: int = 0
    too_small: int = 0
    own_holds: int = 0
    holds_filed: int = 0
    revives_asked: int = 0
    revives_refused: int = 0
    pulls_revived: int = 0
    run_revives_asked: int = 0
    run_revives_refused: int = 0
    pulls_revived_run: int = 0
    pins_followed: int = 0
    index_errors: dict[str, int] = field(default_factory=dict)


class PeerPulls:
    """The replica's side of the index for session turns: begin (take, claim) and file."""

    def __init__(
        self,
        store: Any,
        *,
        instance_id: str,
        url: str,
        secret: bytes,
        client: httpx.AsyncClient | None = None,
        min_tokens: int = MIN_PULL_TOKENS,
        clock: Any = time.monotonic,
        engines: int = 1,
    ) -> None:
        #: The shared index (a SessionStore and a Membership: the publisher's store).
        self.store = store
        self.instance_id = instance_id
        #: The data-parallel engines behind this API server, each a member of its own.
        self.engines = max(1, int(engines))
        self.url = url
        self.secret = secret
        self.client = client or httpx.AsyncClient(timeout=CLAIM_TIMEOUT_S)
        #: The floor of the holder's revives and of the block-run lookup (the cost model decides
        #: each pull above it).
        self.min_tokens = min_tokens
        self.clock = clock
        self.counts = PeerCounts()
        #: Whether a pull beats recomputing, and the speeds measured here.
        self.cost = PullCostModel()
        #: This instance's block size (the index's chains count blocks); 0: unknown.
        self.block_size = 0
        self._members: tuple[float, list[InstanceRecord]] = (float("-inf"), [])
        self._filing: set[asyncio.Task[None]] = set()
        #: The holder's side of revives (this replica's own turns), set by :func:`start`.
        self.reviver: Reviver | None = None
        #: The block-run fallback (None: no fallback), set by :func:`start`.
        self.runs: RunLookup | None = None

    def member_of(self, engine: int) -> str:
        """The member id of this replica's data-parallel engine ``engine``."""
        return member_id(self.instance_id, engine, self.engines)

    def engine_of_member(self, member: str | None) -> int | None:
        """The engine of this replica that ``member`` names (None: the first); None when it
        is none of them."""
        if member is None:
            return 0
        members = [self.member_of(e) for e in range(self.engines)]
        return members.index(member) if member in members else None

    def _index_error(self, op: str, exc: BaseException) -> None:
        self.counts.index_errors[op] = self.counts.index_errors.get(op, 0) + 1
        logger.info("kvbranch peer pulls: index %s failed (%s): recomputing", op, exc)

    async def begin(
        self,
        payload: dict[str, Any],
        key: Key,
        authorization: str | None,
        path: str = PEER_PULL_PATHS[0],
        engine: int = 0,
    ) -> PeerTurn:
        """Take the branch's hold and set the request's transfer params: a claimed handle of
        the peer that holds the branch (or revived it), else :data:`LOCAL_PARAMS`. ``engine``:
        the data-parallel engine the turn goes to. Never raises."""
        self.counts.turns += 1
        started = time.monotonic()
        me = self.member_of(engine)
        payload["kv_transfer_params"] = dict(LOCAL_PARAMS)
        try:
            start = await asyncio.wait_for(self.store.begin_turn(key), INDEX_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - the index is advisory
            self._index_error("begin_turn", exc)
            return PeerTurn(key, 0, started_at=started, engine=engine)
        turn = PeerTurn(
            key,
            start.turn,
            engine=engine,
            cache_salt=payload.get(CACHE_SALT_FIELD),
            started_at=started,
            authorization=authorization,
        )
        hold: Hold | None = start.hold
        left = hold.instance_id if hold is not None else start.home
        turn.left = left if left != me else None
        if hold is None:
            if start.home is not None and start.home != me:
                # The branch's last known chain: what the home's store had of it at most.
                known = len(start.chain) * self.block_size if self.block_size else 0
                tokens = known or None
                if await self._pull_revived(payload, turn, start.home, authorization, tokens):
                    return turn
            await self._pull_run(payload, turn, path, authorization)
            return turn
        if hold.instance_id == me:
            self.counts.own_holds += 1  # its blocks are in this instance's own caches
            return turn
        if not await self._worth_pulling(turn, "hold", hold.num_tokens, hold.instance_id):
            return turn
        claimed, status = await self._claim(hold, authorization)
        if claimed is not None:
            self._pull(payload, turn, claimed, hold, "peer")
        elif status == 410 and hold.instance_id is not None:
            # The holder let the blocks go (new work needed them): its host store may have them.
            if not await self._pull_revived(
                payload, turn, hold.instance_id, authorization, hold.num_tokens
            ):
                await self._pull_run(payload, turn, path, authorization)
        return turn

    async def _peer_load(self, instance_id: str | None) -> int:
        """Requests in flight on ``instance_id`` by its sealed record (0: not listed, or the
        index did not answer; the claim or revive that follows finds out, and counts it)."""
        try:
            records = await self.members()
        except Exception:  # noqa: BLE001 - the index is advisory
            return 0
        record = next((r for r in records if r.instance_id == instance_id), None)
        return max(int(record.load), 0) if record is not None else 0

    async def _worth_pulling(
        self,
        turn: PeerTurn,
        path: PullPath,
        tokens: int,
        instance_id: str | None,
        peer_load: int | None = None,
    ) -> bool:
        """Whether pulling ``tokens`` tokens by ``path`` from ``instance_id`` beats recomputing
        them (:class:`~server.plugin.pull_cost.PullCostModel`); counted either way."""
        load = await self._peer_load(instance_id) if peer_load is None else peer_load
        choice = self.cost.decide(path, tokens, load)
        if not choice.pull:
            self.counts.too_small += 1
            return False
        turn.peer_load = load
        return True

    def _pull(
        self,
        payload: dict[str, Any],
        turn: PeerTurn,
        claimed: dict[str, Any],
        hold: Hold,
        source: str,
    ) -> None:
        payload["kv_transfer_params"] = dict(
            claimed, do_remote_decode=True, do_remote_prefill=False
        )
        self.counts.pulls_claimed += 1
        self.counts.pulled_hold_tokens += hold.num_tokens
        turn.source = source
        turn.held_tokens = hold.num_tokens

    def observe(self, turn: PeerTurn, split: Any) -> None:
        """Measure this replica's prefill speed or the link's from a finished turn: its split
        (tokens pulled and recomputed, as the connector counted them) and its time to first
        token (streams only: a JSON answer's time includes its decode). Never raises."""
        if turn.first_token_at is None or not isinstance(split, dict):
            return
        try:
            pulled = int(split.get("remote_hit_tokens") or 0)
            computed = int(split.get("recomputed_tokens") or 0)
        except (TypeError, ValueError):
            return
        seconds = turn.first_token_at - turn.started_at
        path = PATH_OF_SOURCE.get(turn.source)
        if path is None and pulled == 0:
            self.cost.observe_prefill(computed, seconds)
        elif path is not None and pulled > 0:
            self.cost.observe_pull(path, pulled, computed, seconds, turn.peer_load)

    async def _pull_revived(
        self,
        payload: dict[str, Any],
        turn: PeerTurn,
        instance_id: str,
        authorization: str | None,
        tokens: int | None,
    ) -> bool:
        """Ask ``instance_id`` to revive the branch from its host store (when a pull of the
        ``tokens`` it may have beats recomputing; unknown: asked); claim and pull the fresh
        hold it answers with. Whether it is pulled (else: the fallback, or recompute)."""
        if tokens is not None and not await self._worth_pulling(
            turn, "revive", tokens, instance_id
        ):
            return False
        hold = await self._revive(instance_id, turn.key, authorization)
        if hold is None:
            return False
        claimed, _ = await self._claim(hold, authorization)
        if claimed is None:
            return False
        self._pull(payload, turn, claimed, hold, "revived")
        self.counts.pulls_revived += 1
        return True

    async def _pull_run(
        self, payload: dict[str, Any], turn: PeerTurn, path: str, authorization: str | None
    ) -> None:
        """The fallback: a block-run revive on the member holding the longest run of the
        prompt's blocks in its host store, claimed and pulled. Anything else: recompute."""
        if self.runs is None:
            return
        try:
            found = await asyncio.wait_for(
                self.runs.find(payload, path, await self.members(), engine=turn.engine),
                REVIVE_WAIT_S,
            )
        except Exception as exc:  # noqa: BLE001 - the index, the connector: advisory
            self._index_error("block_hits", exc)
            return
        if found is None:
            return
        beyond_own = (found.run_blocks - found.own_blocks) * self.runs.block_size
        if not await self._worth_pulling(
            turn, "run", beyond_own, found.member.instance_id, found.member.load
        ):
            return
        self.counts.run_revives_asked += 1
        hold = await self._revive(found.member.instance_id, turn.key, authorization, run=found)
        claimed = (await self._claim(hold, authorization))[0] if hold is not None else None
        if hold is None or claimed is None:
            self.counts.run_revives_refused += 1
            return
        self._pull(payload, turn, claimed, hold, "revived_run")
        self.counts.pulls_revived_run += 1

    async def members(self) -> list[InstanceRecord]:
        """The live members whose record's seal holds (reused for :data:`MEMBERS_TTL_S`)."""
        at, records = self._members
        if self.clock() - at < MEMBERS_TTL_S:
            return records
        listed = await asyncio.wait_for(self.store.members(), INDEX_TIMEOUT_S)
        records = [r for r in listed if record_seal.verify(r, self.secret)]
        self._members = (self.clock(), records)
        return records

    async def peer_of(self, hold: Hold) -> InstanceRecord | None:
        """The live, sealed member that issued ``hold``, when the NIXL side channel its sealed
        record names is the one the hold's handle names; None otherwise."""
        try:
            records = await self.members()
        except Exception as exc:  # noqa: BLE001
            self._index_error("members", exc)
            return None
        params = hold.params
        channel = f"{params.get('remote_host')}:{params.get('remote_port')}"
        for record in records:
            if record.instance_id == hold.instance_id and record.nixl and record.nixl == channel:
                return record
        return None

    def _signed(self, path: str, content: bytes, authorization: str | None) -> dict[str, str]:
        headers = {
            "content-type": "application/json",
            ROUTER_PROOF_HEADER: sign(self.secret, "POST", path, content),
        }
        if authorization:
            headers["authorization"] = authorization  # the replicas share their API keys
        return headers

    async def _claim(
        self, hold: Hold, authorization: str | None
    ) -> tuple[dict[str, Any] | None, int | None]:
        """The peer's claim of its hold, added to the handle, and the peer's HTTP status; no
        claim when there is no such live peer or it no longer holds the blocks (then this turn
        recomputes, or asks for a revive)."""
        peer = await self.peer_of(hold)
        if peer is None:
            self.counts.peers_unknown += 1
            return None, None
        content = json.dumps(HoldClaimRequest(handle=hold.params).model_dump()).encode()
        status: int | None = None
        try:
            r = await self.client.post(
                peer.url.rstrip("/") + HOLD_CLAIM_PATH,
                content=content,
                headers=self._signed(HOLD_CLAIM_PATH, content, authorization),
                timeout=CLAIM_TIMEOUT_S,
            )
            status = r.status_code
            claim = r.json().get(CLAIM_FIELD) if r.status_code == 200 else None
            if claim is not None:
                HoldClaimResult.model_validate({CLAIM_FIELD: claim})
        except (httpx.HTTPError, ValueError, AttributeError) as exc:
            logger.info("kvbranch peer pulls: claim on %s failed (%s)", peer.url, exc)
            claim = None
        if not isinstance(claim, dict):
            self.counts.claims_refused += 1
            return None, status
        return dict(hold.params, **{CLAIM_FIELD: claim}), status

    async def _revive(
        self,
        instance_id: str,
        key: Key,
        authorization: str | None,
        run: RunFound | None = None,
    ) -> Hold | None:
        """The fresh hold ``instance_id`` answers a revive of ``key``'s branch with (of
        ``run``'s token ids, for a block-run revive); None when it is no live sealed member or
        refuses (no record, too little in its host store, busy). The member's URL is its
        sealed record's; the handle is checked against that record's NIXL channel by the claim
        that follows."""
        try:
            records = await self.members()
        except Exception as exc:  # noqa: BLE001
            self._index_error("members", exc)
            return None
        peer = next((r for r in records if r.instance_id == instance_id), None)
        if peer is None:
            self.counts.peers_unknown += 1
            return None
        body: dict[str, Any] = {"session_id": key[1], "branch_id": key[2]}
        if run is None:
            self.counts.revives_asked += 1
        else:
            body.update(token_ids=run.token_ids, cache_salt=run.cache_salt, member=peer.instance_id)
        content = json.dumps(body).encode()
        try:
            r = await self.client.post(
                peer.url.rstrip("/") + REVIVE_PATH,
                content=content,
                headers=self._signed(REVIVE_PATH, content, authorization),
                timeout=REVIVE_WAIT_S,
            )
            handle = r.json().get(REVIVE_HANDLE_FIELD) if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError, AttributeError) as exc:
            logger.info("kvbranch peer pulls: revive on %s failed (%s)", peer.url, exc)
            handle = None
        if not isinstance(handle, dict) or not handle.get(REMOTE_BLOCK_IDS):
            if run is None:
                self.counts.revives_refused += 1
            return None
        return Hold(peer.url, peer.instance_id, handle)

    async def file(self, turn: PeerTurn, params: Any) -> None:
        """File this instance's handle for the branch's next turn (and record that the session
        lives here, for session routes); take the branch's pin over from the member it left.
        Never raises."""
        if turn.left is not None:
            task = asyncio.get_running_loop().create_task(self._follow_pin(turn))
            self._filing.add(task)
            task.add_done_callback(self._filing.discard)
        if not isinstance(params, dict) or not params.get(REMOTE_BLOCK_IDS):
            return
        if self.reviver is not None:
            self.reviver.remember(turn.key, turn.turn, turn.cache_salt, params, turn.engine)
        me = self.member_of(turn.engine)
        hold = Hold(self.url, me, dict(params), turn=turn.turn)
        tenant, session = turn.key[0], turn.key[1]
        try:
            if await asyncio.wait_for(self.store.put_hold(turn.key, hold), INDEX_TIMEOUT_S):
                self.counts.holds_filed += 1
            await asyncio.wait_for(
                self.store.add_session_instances(tenant, session, [me]),
                INDEX_TIMEOUT_S,
            )
            # Where a peer asks for a revive once the hold's offer has ended.
            await asyncio.wait_for(self.store.set_home(tenant, session, me), INDEX_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001
            self._index_error("put_hold", exc)

    async def _follow_pin(self, turn: PeerTurn) -> None:
        """Carry the branch's pin over from the member it left (by that member's sealed record:
        nothing the client sent names it); off the answer's path. Never raises."""
        try:
            records = await self.members()
        except Exception as exc:  # noqa: BLE001
            self._index_error("members", exc)
            return
        peer = next((r for r in records if r.instance_id == turn.left), None)
        if peer is None:
            return
        if await follow_pin(self.client, turn.key, peer.url, self.url, turn.authorization):
            self.counts.pins_followed += 1

    def counters(self) -> dict[str, Any]:
        c = self.counts
        return {
            "turns": c.turns,
            "pulls_claimed": c.pulls_claimed,
            "pulled_hold_tokens": c.pulled_hold_tokens,
            "claims_refused": c.claims_refused,
            "peers_unknown": c.peers_unknown,
            "too_small": c.too_small,
            "own_holds": c.own_holds,
            "holds_filed": c.holds_filed,
            "revives_asked": c.revives_asked,
            "revives_refused": c.revives_refused,
            "pulls_revived": c.pulls_revived,
            "run_revives_asked": c.run_revives_asked,
            "run_revives_refused": c.run_revives_refused,
            "pulls_revived_run": c.pulls_revived_run,
            "pins_followed": c.pins_followed,
            "revives_served": self.reviver.counters() if self.reviver is not None else {},
            "index_errors": dict(c.index_errors),
            "pull_cost": self.cost.snapshot(),
        }


def start(state: Any) -> PeerPulls | None:
    """An aggregated replica's peer pulls, over the index its publisher opened; None when the
    launcher did not make this instance one (``KVBRANCH_PEER_PULL``) or no index is open."""
    from server.common.env import ENV_PEER_PULL

    publisher = getattr(state, "index_publisher", None)
    if os.environ.get(ENV_PEER_PULL) != "1" or publisher is None:
        return None
    record = publisher.record()
    engines = state.engines.count
    pulls = PeerPulls(
        publisher.store,
        instance_id=state.instance_id,
        url=record.url,
        secret=publisher.secret,
        engines=engines,
    )
    pulls.block_size = record.block_size
    if state.control is not None and record.block_size > 0:
        from server.plugin.revive import Reviver, control_coverage, engine_prefill
        from server.plugin.run_lookup import RunLookup, engine_render

        controls = state.engines.controls or [state.control]
        cover = control_coverage(controls)
        pulls.reviver = Reviver(
            cover,
            engine_prefill(state.engine_client, engines),
            block_size=record.block_size,
            min_tokens=pulls.min_tokens,
            run_coverage=cover,
        )
        pulls.runs = RunLookup(
            publisher.store,
            engine_render(state.engine_client),
            cover,
            instance_id=state.instance_id,
            block_size=record.block_size,
            min_tokens=pulls.min_tokens,
            engines=engines,
        )
    logger.info(
        "kvbranch peer pulls on: session turns pull from the replica holding them%s",
        "; peers may revive this replica's turns from its host store" if pulls.reviver else "",
    )
    return pulls
