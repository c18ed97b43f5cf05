"""A pin follows its session to the replica the session moved to.

A client pins a branch (``POST /v1/kvbranch/sessions/{id}/branches/{b}/pin``) on the replicas
the index records for the session; the pin keeps the branch's blocks in that replica's host
store. When a turn of the branch is served by another replica (its replica was overloaded or
gone, or a plain front sent it elsewhere), the branch's KV now lives there, and so must its
pin: once that turn is answered (the new replica has the branch then), the branch is read on
the replica it came from and, if it was pinned there, pinned on the new one for what was left
of the pin's lease. The lease renews with every use there after (the instance's own rule).
Two callers: our router, for a turn it moved, and an aggregated replica, for a turn a plain
front sent it (:mod:`server.plugin.peer_pull`); both name the replicas by URLs from sealed
member records, never from the request.

Done with the client's own ``Authorization``, so it reads and pins only what that tenant could
itself; ids are checked before they become a path. Best effort: a read or pin that fails
leaves the branch unpinned on the new replica (its blocks stay under LRU retention), and the
turn's answer never waits for it.
"""

from __future__ import annotations

import logging

import httpx
from pydantic import ValidationError

from sdk.contract import BranchInfo, PinRequest, branch_path, check_id

logger = logging.getLogger("kvbranch.pin_follow")

#: A pin with less than this left is not worth carrying over.
MIN_LEFT_S = 1.0
FOLLOW_TIMEOUT_S = 10.0


async def follow_pin(
    client: httpx.AsyncClient,
    key: tuple[str, str, str],
    left: str,
    now_on: str,
    authorization: str | None,
) -> bool:
    """Pin ``key``'s branch on the replica at URL ``now_on`` when it is pinned on the one at
    ``left``; True when pinned."""
    try:
        session, branch = check_id(key[1]), check_id(key[2])
    except ValueError:
        return False
    path = branch_path(session, branch)
    headers = {"authorization": authorization} if authorization else {}
    try:
        r = await client.get(left.rstrip("/") + path, headers=headers, timeout=FOLLOW_TIMEOUT_S)
        if r.status_code != 200:
            return False
        info = BranchInfo.model_validate_json(r.content)
        left_s = info.pin_expires_in_s or 0.0
        if not info.pinned or left_s < MIN_LEFT_S:
            return False
        body = PinRequest(ttl_s=left_s).model_dump()
        r = await client.post(
            now_on.rstrip("/") + path + "/pin", json=body, headers=headers, timeout=FOLLOW_TIMEOUT_S
        )
    except (httpx.HTTPError, ValidationError) as exc:
        logger.debug("the pin of %s did not follow it to %s: %s", path, now_on, exc)
        return False
    if r.status_code != 200:
        logger.debug("the pin of %s did not follow it to %s: HTTP %s", path, now_on, r.status_code)
        return False
    return True
