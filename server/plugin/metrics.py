"""Prometheus metrics for kvbranch, served on vLLM's own ``/metrics``.

A custom collector reads the connector's counters over the control socket at scrape time, so
the numbers are the engine's own (no second bookkeeping in the API process).

prometheus_client collects synchronously, inside the API server's event loop: a blocking
control-socket call there (up to its timeout) would stall every request the process serves.
So :class:`MetricsRefresh`, an ASGI layer in front of ``/metrics``, fetches the stats with the
async control client first, and the collector serves that snapshot; only a collection that
finds no fresh snapshot (another exporter path) calls the socket synchronously."""

from __future__ import annotations

import logging
import time
from typing import Any

from prometheus_client import REGISTRY
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from sdk.contract import PDStats
from server.connector.control.models import EngineStats, GetStats, SchedulerStats
from server.connector.control.transport import (
    AsyncControlClient,
    ControlError,
    call_sync,
    engine_socket_path,
)
from server.plugin.engine_stats import gather_stats, merge_stats

logger = logging.getLogger("kvbranch.metrics")
_registered: dict[str, KVBranchCollector] = {}
SCRAPE_TIMEOUT_S = 2.0
#: A snapshot the refresh layer fetched is served for this long.
FRESH_S = 1.0
METRICS_PATH = "/metrics"


class KVBranchCollector:
    def __init__(self, control_path: str, engines: int = 1) -> None:
        self.control_path = control_path
        #: Every engine core's socket (data parallel): the stats are theirs, merged.
        self.paths = [engine_socket_path(control_path, i) for i in range(max(1, engines))]
        #: (when, the stats or None when the connector did not answer)
        self._snapshot: tuple[float, EngineStats | None] | None = None

    async def refresh(self) -> None:
        """Fetch the stats without blocking the event loop (the refresh layer calls it)."""
        clients = [AsyncControlClient(path, timeout=SCRAPE_TIMEOUT_S) for path in self.paths]
        try:
            stats = await gather_stats(clients, GetStats(all_owners=True))
        except (ControlError, OSError, ValueError, TimeoutError) as exc:
            logger.debug("kvbranch metrics unavailable: %s", exc)
            self._snapshot = (time.monotonic(), None)  # "down", without a blocking retry
            return
        self._snapshot = (time.monotonic(), stats)

    def _stats(self) -> EngineStats:
        snapshot, self._snapshot = self._snapshot, None  # each snapshot serves one scrape
        if snapshot is not None and time.monotonic() - snapshot[0] < FRESH_S:
            if snapshot[1] is None:
                raise ControlError(503, "the connector did not answer")
            return snapshot[1]
        return merge_stats(
            [
                call_sync(path, GetStats(all_owners=True), timeout=SCRAPE_TIMEOUT_S)
                for path in self.paths
            ]
        )

    def collect(self):
        try:
            stats = self._stats()
        except (ControlError, OSError, ValueError) as exc:
            logger.debug("kvbranch metrics unavailable: %s", exc)
            up = GaugeMetricFamily("kvbranch_connector_up", "1 when the connector answers")
            up.add_metric([], 0)
            yield up
            return
        store = stats.store
        up = GaugeMetricFamily("kvbranch_connector_up", "1 when the connector answers")
        up.add_metric([], 1)
        yield up
        tokens = CounterMetricFamily(
            "kvbranch_prompt_tokens", "Prompt tokens by where their KV came from", labels=["source"]
        )
        for source, value in stats.hits_tokens.items():
            tokens.add_metric([source], value)
        yield tokens
        yield from _unlabelled(
            CounterMetricFamily,
            [
                ("kvbranch_requests", "Completed requests seen by the connector", stats.requests),
                ("kvbranch_prefetches", "Prefetch requests run", stats.prefetches),
                ("kvbranch_store_evictions", "Host store LRU evictions", store.evictions),
                ("kvbranch_store_saved_blocks", "Blocks copied device to host", store.saved_blocks),
                (
                    "kvbranch_store_loaded_blocks",
                    "Blocks copied host to device",
                    store.loaded_blocks,
                ),
                (
                    "kvbranch_pins_degraded",
                    "Leases demoted to LRU by the pin budget",
                    stats.pins_degraded,
                ),
                (
                    "kvbranch_pins_refused",
                    "Explicit pins refused (over budget)",
                    stats.pins_refused,
                ),
            ],
        )
        yield from _unlabelled(
            GaugeMetricFamily,
            [
                ("kvbranch_store_used_bytes", "Host store bytes in use", store.used_bytes),
                (
                    "kvbranch_store_capacity_bytes",
                    "Host store capacity",
                    store.capacity_blocks * store.block_bytes,
                ),
                ("kvbranch_pinned_bytes", "Bytes held by pins", store.pinned_bytes),
                ("kvbranch_pin_budget_bytes", "Pin budget", store.pin_budget_bytes),
                ("kvbranch_sessions", "Live sessions", stats.num_sessions),
            ],
        )
        yield from _pd_metrics(stats.pd)
        yield from _scheduler_metrics(stats.scheduler)


def _unlabelled(kind: type, rows: list[tuple[str, str, float]]):
    """One family of ``kind`` (counter or gauge) without labels per ``(name, doc, value)``."""
    for name, doc, value in rows:
        family = kind(name, doc)
        family.add_metric([], value)
        yield family


def _scheduler_metrics(sched: SchedulerStats | None):
    """The warm-first scheduler's own decisions (docs/scheduling.md), where it runs."""
    if sched is None:
        return
    yield from _unlabelled(
        CounterMetricFamily,
        [
            (
                "kvbranch_scheduler_preemptions",
                "Cold prefills preempted for a warmer waiting request",
                sched.preemptions,
            ),
            (
                "kvbranch_scheduler_backfills",
                "Steps that admitted a request past a better-ranked one that did not fit",
                sched.backfills,
            ),
            (
                "kvbranch_scheduler_passed_requests",
                "Waiting requests passed by a backfill, summed over steps",
                sched.passed_requests,
            ),
            (
                "kvbranch_scheduler_paused_steps",
                "Steps that left running cold prefills out for a resumed turn's prefill",
                sched.paused_steps,
            ),
        ],
    )


def _pd_metrics(pd: PDStats | None):
    """P/D instances and aggregated replicas: holds (a lease on device blocks), how often they
    yielded to new work, steps where a waiting request found the device cache full, declined
    handles, synchronous pulls and pulls given up in flight (blocks that stay pinned until the
    read ends: a value that never drops is a read that never ended)."""
    if pd is None:
        return
    yield from _unlabelled(
        GaugeMetricFamily,
        [
            ("kvbranch_pd_holds", "Conversations held on the device for a peer's pull", pd.holds),
            ("kvbranch_pd_held_blocks", "Device blocks held for a peer's pull", pd.held_blocks),
            (
                "kvbranch_pd_late_read_blocks_pinned",
                "Device blocks pinned for pulls given up while NIXL still had them in flight",
                pd.late_read_blocks_pinned,
            ),
        ],
    )
    yield from _unlabelled(
        CounterMetricFamily,
        [
            ("kvbranch_pd_holds_placed", "Holds placed for a peer's pull", pd.holds_placed),
            (
                "kvbranch_pd_holds_released",
                "Holds released early because new work needed the blocks",
                pd.holds_released_for_new_work,
            ),
            (
                "kvbranch_pd_stalled_steps",
                "Steps where a waiting request could not get device blocks while holds existed",
                pd.stalled_steps,
            ),
            ("kvbranch_pd_claims", "Holds claimed for a pull", pd.claims),
            (
                "kvbranch_pd_claims_refused",
                "Claims refused (hold released, expired or used)",
                pd.claims_refused,
            ),
            (
                "kvbranch_pd_sync_reads",
                "Pulls loaded before the step's forward (the forward waited for the read)",
                pd.sync_reads,
            ),
            (
                "kvbranch_pd_sync_reads_not_landed",
                "Synchronous pulls that did not land before the forward (recomputed)",
                pd.sync_reads_not_landed,
            ),
            (
                "kvbranch_pd_late_reads",
                "Pulls given up while NIXL still had them in flight (recomputed, blocks pinned)",
                pd.late_reads,
            ),
        ],
    )
    declined = CounterMetricFamily(
        "kvbranch_pd_handles_declined",
        "Peer transfer handles declined (the prompt recomputed)",
        labels=["reason"],
    )
    for reason, value in pd.handles_declined.items():
        declined.add_metric([reason], value)
    yield declined


def register_collector(control_path: str, engines: int = 1) -> None:
    if control_path in _registered:
        return
    collector = KVBranchCollector(control_path, engines)
    REGISTRY.register(collector)
    _registered[control_path] = collector


class MetricsRefresh:
    """ASGI layer: before vLLM's ``/metrics`` collects, refresh kvbranch's snapshot with the
    async control client (see the module docstring)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope.get("path", "").rstrip("/") == METRICS_PATH:
            for collector in list(_registered.values()):
                await collector.refresh()
        await self.app(scope, receive, send)


class IndexPublisherCollector:
    """The instance's cluster-index publisher (:mod:`server.index.publisher`): whether the index
    is reachable, heartbeats, block-event batches, the generation of its block entries. Read
    from the publisher's own counters at scrape time (in-process: nothing to wait for)."""

    def __init__(self, publisher: Any) -> None:
        self.publisher = publisher

    def collect(self):
        c = self.publisher.counters()
        up = GaugeMetricFamily("kvbranch_index_up", "1 while the cluster index answers")
        up.add_metric([], 0 if c["outage"] else 1)
        yield up
        gen = GaugeMetricFamily(
            "kvbranch_index_generation",
            "Generation of this instance's block entries per tier (both bumped on a lost "
            "event stream or a restarted publisher, one on its tier's cleared cache: older "
            "entries become invisible)",
            labels=["tier"],
        )
        gen.add_metric(["device"], c["generation"])
        gen.add_metric(["host"], c["host_generation"])
        yield gen
        beats = CounterMetricFamily(
            "kvbranch_index_heartbeats", "Heartbeats into the cluster index", labels=["result"]
        )
        beats.add_metric(["sent"], c["heartbeats_sent"])
        beats.add_metric(["failed"], c["heartbeats_failed"])
        yield beats
        batches = CounterMetricFamily(
            "kvbranch_index_event_batches",
            "KV event batches from this instance's engines, by what became of them",
            labels=["result"],
        )
        for result in ("applied", "dropped", "stale"):
            batches.add_metric([result], c[f"batches_{result}"])
        yield batches
        replays = CounterMetricFamily(
            "kvbranch_index_event_replays",
            "Gaps in an engine's KV event stream: replays requested, and gaps no replay filled "
            "(each bumped the generation)",
            labels=["result"],
        )
        replays.add_metric(["requested"], c["replays"])
        replays.add_metric(["failed"], c["replay_failures"])
        yield replays


def register_index_collector(publisher: Any) -> None:
    REGISTRY.register(IndexPublisherCollector(publisher))


class PeerPullCollector:
    """An aggregated replica's session turns (:mod:`server.plugin.peer_pull`): where each
    turn's history came from, claims on peers, holds filed. Read at scrape time."""

    def __init__(self, pulls: Any) -> None:
        self.pulls = pulls

    def collect(self):
        c = self.pulls.counters()
        turns = CounterMetricFamily(
            "kvbranch_peer_turns",
            "Session turns on this replica by where their history was to come from: pulled from "
            "the peer holding the branch, pulled after the peer revived it from its host store "
            "(revived; revived_run: a block-run revive on the member whose host store holds "
            "the longest run of the prompt's blocks), this instance's own hold, none (new "
            "branch, too_small: recomputing estimated cheaper than the pull, peer not listed, "
            "claim or revive refused, index "
            "unreachable)",
            labels=["source"],
        )
        runs = c.get("pulls_revived_run", 0)
        turns.add_metric(["peer"], c["pulls_claimed"] - c["pulls_revived"] - runs)
        turns.add_metric(["revived"], c["pulls_revived"])
        turns.add_metric(["revived_run"], runs)
        turns.add_metric(["revive_refused"], c["revives_refused"])
        turns.add_metric(["run_revive_refused"], c.get("run_revives_refused", 0))
        turns.add_metric(["own_hold"], c["own_holds"])
        turns.add_metric(["too_small"], c["too_small"])
        turns.add_metric(["peer_unknown"], c["peers_unknown"])
        turns.add_metric(["claim_refused"], c["claims_refused"])
        yield turns
        yield from _unlabelled(
            CounterMetricFamily,
            [
                (
                    "kvbranch_peer_pull_offered_tokens",
                    "Tokens the peers held for turns this replica claimed (what it pulls is the "
                    "verified prefix of these: kvbranch_hits_tokens{source=remote})",
                    c["pulled_hold_tokens"],
                ),
                (
                    "kvbranch_peer_holds_filed",
                    "This replica's holds filed in the index for next turns",
                    c["holds_filed"],
                ),
                (
                    "kvbranch_peer_pins_followed",
                    "Pins carried over from the member a session turn left (the branch's pin "
                    "there, for what was left of its lease) once the turn was answered here",
                    c.get("pins_followed", 0),
                ),
            ],
        )
        served = c.get("revives_served") or {}
        revives = CounterMetricFamily(
            "kvbranch_peer_revives",
            "Peers' revives of this replica's turns from its host store, by outcome: served, or "
            "why not (unknown branch, busy, not_covered, identity, timeout, no_hold, ...)",
            labels=["outcome"],
        )
        for outcome, n in sorted((served.get("outcomes") or {}).items()):
            revives.add_metric([outcome], n)
        yield revives
        yield from _unlabelled(
            CounterMetricFamily,
            [
                (
                    "kvbranch_peer_revived_tokens",
                    "Tokens this replica loaded from its host store and held for peers' revives",
                    served.get("revived_tokens", 0),
                )
            ],
        )
        errors = CounterMetricFamily(
            "kvbranch_peer_index_errors",
            "Index calls of session turns that failed (the turn recomputed)",
            labels=["op"],
        )
        for op, n in sorted(c["index_errors"].items()):
            errors.add_metric([op], n)
        yield errors
        yield from _pull_cost_metrics(c.get("pull_cost") or {})


def _pull_cost_metrics(cost: dict[str, Any]):
    """The pull-or-recompute decisions of :mod:`server.plugin.pull_cost` and the estimates
    they were taken with (the priors until measured)."""
    decisions = CounterMetricFamily(
        "kvbranch_peer_pull_decisions",
        "Pull-or-recompute decisions by path (hold: the branch's hold; revive: the branch "
        "revived on its home or holder; run: a block-run revive) and what was chosen (explore: "
        "pulled although estimated slower, to measure the link again)",
        labels=["path", "decision"],
    )
    for path, outcomes in sorted((cost.get("decisions") or {}).items()):
        for decision, n in sorted(outcomes.items()):
            decisions.add_metric([path, decision], n)
    yield decisions
    prefill = GaugeMetricFamily(
        "kvbranch_peer_pull_prefill_tokens_per_second",
        "This replica's estimated prefill speed (a moving average of measured turns; a prior "
        "until one is measured)",
    )
    prefill.add_metric([], cost.get("prefill_tokens_per_s", 0.0))
    yield prefill
    link = GaugeMetricFamily(
        "kvbranch_peer_pull_link_tokens_per_second",
        "The estimated pull speed by kind (hold: a claimed hold; revive: a revived one, the "
        "peer's revive included), a moving average of measured pulls or the prior",
        labels=["kind"],
    )
    for kind, value in sorted((cost.get("link_tokens_per_s") or {}).items()):
        link.add_metric([kind], value)
    yield link
    samples = CounterMetricFamily(
        "kvbranch_peer_pull_samples",
        "Turns measured by the pull cost model (prefill; hold and revive: pulls)",
        labels=["what"],
    )
    samples.add_metric(["prefill"], cost.get("prefill_samples", 0))
    for kind, n in sorted((cost.get("link_samples") or {}).items()):
        samples.add_metric([kind], n)
    yield samples


def register_peer_pull_collector(pulls: Any) -> None:
    REGISTRY.register(PeerPullCollector(pulls))
