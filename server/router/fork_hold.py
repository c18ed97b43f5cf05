"""A fork's new branch starts with its parent's hold.

A fork (``POST /v1/kvbranch/sessions/{id}/branches``) makes a branch whose history is its
parent's (up to the fork point). The parent's last turn is held on a D — or on the replica
that served it — while the index offers it, so the new branch's first turn can be served by
that D alone or pull from it, like any resumed turn, instead of recomputing a history the P it
would otherwise take never saw (the parent's turns may all have stayed on D). The router
offers the parent's hold to the new branch too, for what is left of the parent's offer.

Nothing is weakened: the hold is D's single-use handle, so of a parent and its forks one pull
gets it and the others' claims are refused (they recompute), and P checks the handle's token
prefix against the new branch's prompt like every pull's (a fork at an earlier point pulls only
the verified common prefix). The parent's own hold stays where it was.
"""

from __future__ import annotations

import dataclasses
import logging

from pydantic import ValidationError

from sdk.contract import ForkRequest
from server.index import IndexUnavailable, SessionStore

logger = logging.getLogger("kvbranch.router")


async def share_parent_hold(index: SessionStore, tenant: str, session: str, body: bytes) -> bool:
    """After a fork every instance accepted: offer the parent branch's live hold to the new
    branch (``body``: the fork as sent, with its branch id). True when one was offered."""
    try:
        fork = ForkRequest.model_validate_json(body)
    except ValidationError:
        return False
    if fork.branch_id is None or fork.branch_id == fork.parent:
        return False
    try:
        held = await index.peek_hold((tenant, session, fork.parent))
        if held is None or held.expires_in_s <= 0:
            return False
        shared = dataclasses.replace(held, turn=0)  # the new branch has had no turn yet
        return await index.put_hold(
            (tenant, session, fork.branch_id), shared, ttl_s=held.expires_in_s
        )
    except IndexUnavailable:
        logger.debug("the index is unreachable: the fork's first turn recomputes its history")
        return False
