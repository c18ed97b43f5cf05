"""D's returned ``kv_transfer_params``, carried to the conversation's next turn on P.

vLLM's bidirectional ``NixlConnector`` leaves it to the proxy to hand D's params (the block ids
D holds for the conversation, under ``decoder_kv_blocks_ttl``) to the next turn's prefill;
vLLM's own example proxies forget them after each turn. This is the one piece of state the
upstream baseline's proxy keeps, keyed by the (session, branch) the workload names:

* **one use**: D's blocks serve one read; a second turn on the same handle would read blocks
  D may have freed after the first read (upstream's worker frees a hold once it was read);
* **dropped at TTL − margin**: D releases the blocks at its TTL, and P's worker declines a read
  within 5 s of D's deadline, so an older handle would only cost P a failed pull;
* **a fork's first turn may use its parent's**: a branch with nothing of its own takes its
  parent's handle (one use still: the first branch to ask gets it).

Pure logic, no I/O: :mod:`benchmarks.upstream_pd.proxy` feeds it the clock.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

#: Seconds before D's TTL at which a handle is no longer offered (as kvbranch's router).
TTL_MARGIN_S = 5.0

Key = tuple[str, str]


@dataclass
class Carried:
    params: dict[str, Any]
    deadline: float


@dataclass
class ParamsCarry:
    """Per (session, branch): D's last params, until used once or until ``ttl_s`` − margin."""

    ttl_s: float
    margin_s: float = TTL_MARGIN_S
    held: dict[Key, Carried] = field(default_factory=dict)
    #: keys D has filed params for at least once (a branch past its first turn)
    known: set[Key] = field(default_factory=set)
    counts: dict[str, int] = field(
        default_factory=lambda: {"filed": 0, "taken": 0, "taken_from_parent": 0, "expired": 0}
    )

    def file(self, key: Key, params: dict[str, Any] | None, now: float) -> None:
        """D finished a turn of ``key``: its params replace any older ones (those name blocks
        of a shorter history, which D frees at their own TTL)."""
        if not params or not params.get("remote_block_ids"):
            self.held.pop(key, None)
            return
        self.held[key] = Carried(dict(params), now + self.ttl_s - self.margin_s)
        self.known.add(key)
        self.counts["filed"] += 1

    def take(self, key: Key, now: float, parent: Key | None = None) -> dict[str, Any] | None:
        """The params P's leg of ``key``'s next turn carries (removed: one use), or None. A
        branch that never had params of its own (a fork's first turn) takes ``parent``'s."""
        own = self._pop_live(key, now)
        if own is not None:
            self.counts["taken"] += 1
            return own
        if parent is None or parent == key or key in self.known:
            return None
        inherited = self._pop_live(parent, now)
        if inherited is not None:
            self.counts["taken_from_parent"] += 1
        return inherited

    def _pop_live(self, key: Key, now: float) -> dict[str, Any] | None:
        carried = self.held.pop(key, None)
        if carried is None:
            return None
        if now >= carried.deadline:
            self.counts["expired"] += 1
            return None
        return carried.params


def prefill_params(carried: dict[str, Any] | None) -> dict[str, Any]:
    """The ``kv_transfer_params`` of P's leg: vLLM's example proxy's (``do_remote_decode``,
    no peer), or D's carried params as D returned them with the two direction flags set for
    P (D already returns them so; set here so that a changed default cannot flip a pull)."""
    if carried is None:
        return {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "remote_engine_id": None,
            "remote_block_ids": None,
            "remote_host": None,
            "remote_port": None,
        }
    return dict(carried, do_remote_decode=True, do_remote_prefill=False)
