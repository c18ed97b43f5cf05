"""Aggregated replicas: whether pulling a turn's history from a peer beats recomputing it.

:mod:`server.plugin.peer_pull` asks :class:`PullCostModel` before each claim and each revive.
A pull costs a fixed overhead (the signed claim and NIXL's handshake), the transfer of its
tokens at the link's speed, and a wait that grows with the peer's load (its engine serves the
reads from NIXL's progress thread on cores it shares with its own forwards, and a revive's
one-token prefill waits in its queue); recomputing costs the tokens at this replica's prefill
speed. The pull is chosen when its estimate is the smaller.

Both speeds are measured here, as exponentially weighted averages of what this replica saw:
its prefill speed from turns that pulled nothing (recomputed tokens over the time to their
first token), the link's from turns that pulled (verified pulled tokens over what is left of
their time to first token once the estimated prefill of their recomputed part, the overhead
and the peer's load wait are taken out). Claims of a hold and revives (which also cost the
peer a host-store load and a one-token prefill) have a link speed each. A link measured slower
than it is would never be pulled over again, so never measured again: after
:data:`EXPLORE_EVERY` pulls in a row turned down for their link's speed alone (an idle peer
would not have changed them), the next is pulled anyway, and measured. Before any
measurement the priors make the choice the fixed floor made before the model existed: a pull
from an idle peer for :data:`MIN_PULL_TOKENS` tokens or more.

Nothing a client sends is an input: the token counts are the sealed handle's or the block
index's, the load is the peer's sealed member record, and the timings are this replica's own.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal

#: The floor the priors reproduce: fewer held tokens are recomputed (a claim and a handshake
#: cost more than one block's prefill).
MIN_PULL_TOKENS = 32
#: What every pull costs whatever its size: the signed claim (an HTTP round trip to the peer)
#: and NIXL's handshake and read setup. Fixed, not measured: the link's speed absorbs the rest.
PULL_OVERHEAD_S = 0.010
#: The link's speed before any pull was measured: a fast local link. Its exact value matters
#: little; the prefill prior below is derived from it so the floor stays where it was.
PRIOR_LINK_TOKENS_PER_S = 200_000.0
#: This replica's prefill speed before any was measured: the speed at which the overhead costs
#: as much as the prefill of just under :data:`MIN_PULL_TOKENS` tokens net of their transfer,
#: so that a pull wins from :data:`MIN_PULL_TOKENS` tokens on (and not below) until this
#: replica has measured itself.
PRIOR_PREFILL_TOKENS_PER_S = 1.0 / (
    1.0 / PRIOR_LINK_TOKENS_PER_S + PULL_OVERHEAD_S / (MIN_PULL_TOKENS - 0.5)
)
#: The wait a claimed pull adds per request in flight on the peer: its reads share the peer's
#: cores with its forwards.
CLAIM_WAIT_PER_PEER_REQUEST_S = 0.002
#: The wait a revive adds per request in flight on the peer: the revive's one-token prefill
#: waits in the peer's queue behind the steps of what is already there.
REVIVE_WAIT_PER_PEER_REQUEST_S = 0.050
#: How much one new measurement moves an average (the rest stays with the history).
EWMA_WEIGHT = 0.2
#: A turn with fewer tokens of the measured kind says more about fixed costs than about speed.
MIN_SAMPLE_TOKENS = 64
#: The shortest time a measured pull is credited with (a turn whose estimated other parts
#: already fill its time to first token would otherwise measure an infinite link).
MIN_SAMPLE_S = 0.001
#: Measured speeds are kept in this range: one absurd sample must not stop or force all pulls.
MIN_TOKENS_PER_S, MAX_TOKENS_PER_S = 1.0, 1e8
#: After this many pulls of one link kind in a row turned down for the link's speed, one is
#: pulled anyway: a link that got faster (or was measured on a bad turn) is measured again.
EXPLORE_EVERY = 20

#: How a pull gets its blocks: claiming a hold the peer still has on its device, or reviving
#: them from its host store first.
LinkKind = Literal["hold", "revive"]
#: The three ways a turn's history can be pulled: the branch's hold, a revive of the branch on
#: its home or holder, a block-run revive of the longest run the index lists.
PullPath = Literal["hold", "revive", "run"]
LINK_OF_PATH: dict[PullPath, LinkKind] = {"hold": "hold", "revive": "revive", "run": "revive"}
PATHS: tuple[PullPath, ...] = ("hold", "revive", "run")
#: What :meth:`PullCostModel.decide` chose: pull (estimated faster), recompute, or explore
#: (pulled although estimated slower, to measure the link again).
OUTCOMES = ("pull", "recompute", "explore")


@dataclass
class Ewma:
    """An exponentially weighted average seeded with a prior (which counts as no sample)."""

    value: float
    weight: float = EWMA_WEIGHT
    samples: int = 0

    def update(self, sample: float) -> None:
        self.value += self.weight * (sample - self.value)
        self.samples += 1


@dataclass(frozen=True)
class PullEstimate:
    """One decision and the numbers behind it, in seconds."""

    path: PullPath
    tokens: int
    peer_load: int
    pull_s: float
    recompute_s: float
    #: Pulled although estimated slower, to measure the link again (:data:`EXPLORE_EVERY`).
    explore: bool = False

    @property
    def pull(self) -> bool:
        return self.explore or self.pull_s < self.recompute_s


def _clamped(tokens_per_s: float) -> float:
    return min(max(tokens_per_s, MIN_TOKENS_PER_S), MAX_TOKENS_PER_S)


@dataclass
class PullCostModel:
    """The estimates, the decisions taken with them, and the measurements that move them."""

    overhead_s: float = PULL_OVERHEAD_S
    prefill: Ewma = field(default_factory=lambda: Ewma(PRIOR_PREFILL_TOKENS_PER_S))
    links: dict[LinkKind, Ewma] = field(
        default_factory=lambda: {
            "hold": Ewma(PRIOR_LINK_TOKENS_PER_S),
            "revive": Ewma(PRIOR_LINK_TOKENS_PER_S),
        }
    )
    #: (path, "pull", "recompute" or "explore") -> how often :meth:`decide` chose it.
    decisions: dict[tuple[PullPath, str], int] = field(default_factory=dict)
    #: Per link kind: pulls turned down for the link's speed since its last pull.
    declined: dict[LinkKind, int] = field(default_factory=dict)

    def peer_wait_s(self, path: PullPath, peer_load: int) -> float:
        """What the peer's load adds to a pull by ``path``."""
        per_request = (
            CLAIM_WAIT_PER_PEER_REQUEST_S
            if LINK_OF_PATH[path] == "hold"
            else REVIVE_WAIT_PER_PEER_REQUEST_S
        )
        return max(peer_load, 0) * per_request

    def estimate(self, path: PullPath, tokens: int, peer_load: int) -> PullEstimate:
        """Both costs of bringing ``tokens`` tokens' KV into this replica: pulled by ``path``
        from a peer with ``peer_load`` requests in flight, or recomputed here."""
        tokens = max(tokens, 0)
        link = self.links[LINK_OF_PATH[path]].value
        pull_s = self.overhead_s + tokens / link + self.peer_wait_s(path, peer_load)
        return PullEstimate(path, tokens, peer_load, pull_s, tokens / self.prefill.value)

    def decide(self, path: PullPath, tokens: int, peer_load: int) -> PullEstimate:
        """:meth:`estimate`, counted in :attr:`decisions`; every :data:`EXPLORE_EVERY`-th pull
        of a link kind in a row turned down for the link's speed alone is pulled anyway."""
        choice = self.estimate(path, tokens, peer_load)
        kind = LINK_OF_PATH[path]
        if choice.pull:
            self.declined[kind] = 0
            outcome = "pull"
        elif tokens >= MIN_PULL_TOKENS and not self.estimate(path, tokens, 0).pull:
            self.declined[kind] = self.declined.get(kind, 0) + 1
            if self.declined[kind] >= EXPLORE_EVERY:
                self.declined[kind] = 0
                choice = replace(choice, explore=True)
            outcome = "explore" if choice.explore else "recompute"
        else:
            outcome = "recompute"  # too few tokens, or the peer's load decided it
        self.decisions[(path, outcome)] = self.decisions.get((path, outcome), 0) + 1
        return choice

    def observe_prefill(self, computed_tokens: int, seconds: float) -> bool:
        """A turn that pulled nothing computed ``computed_tokens`` tokens in ``seconds`` (to its
        first token). Whether it was measured (too few tokens or no time: not)."""
        if computed_tokens < MIN_SAMPLE_TOKENS or seconds <= 0:
            return False
        self.prefill.update(_clamped(computed_tokens / seconds))
        return True

    def observe_pull(
        self,
        path: PullPath,
        pulled_tokens: int,
        computed_tokens: int,
        seconds: float,
        peer_load: int,
    ) -> bool:
        """A turn pulled ``pulled_tokens`` verified tokens by ``path`` from a peer that had
        ``peer_load`` requests in flight, computed ``computed_tokens`` itself, and had its first
        token ``seconds`` after it began. The link is credited with what is left of that time
        once the estimated prefill, the overhead and the peer's load wait are taken out."""
        if pulled_tokens < MIN_SAMPLE_TOKENS or seconds <= 0:
            return False
        rest = (
            seconds
            - max(computed_tokens, 0) / self.prefill.value
            - self.overhead_s
            - self.peer_wait_s(path, peer_load)
        )
        self.links[LINK_OF_PATH[path]].update(_clamped(pulled_tokens / max(rest, MIN_SAMPLE_S)))
        return True

    def snapshot(self) -> dict[str, object]:
        """The current estimates and the decision counts, for the stats and ``/metrics``."""
        return {
            "prefill_tokens_per_s": self.prefill.value,
            "prefill_samples": self.prefill.samples,
            "link_tokens_per_s": {kind: e.value for kind, e in self.links.items()},
            "link_samples": {kind: e.samples for kind, e in self.links.items()},
            "overhead_s": self.overhead_s,
            "decisions": {
                path: {outcome: self.decisions.get((path, outcome), 0) for outcome in OUTCOMES}
                for path in PATHS
            },
        }
