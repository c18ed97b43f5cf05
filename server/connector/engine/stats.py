"""Copy latency of the host store, through vLLM's own connector-stats plumbing: the worker
records each step's load/save copy time in :class:`KVBranchTransferStats`, vLLM ships it to the
API process, and :class:`KVBranchPromMetrics` observes it into a Prometheus histogram on
``/metrics`` (``kvbranch_host_copy_seconds{direction="load"|"save"}``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from server.connector.vllm_compat import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


@dataclass
class KVBranchTransferStats(KVConnectorStats):
    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data = {"load_seconds": [], "save_seconds": [], "load_blocks": 0, "save_blocks": 0}

    def record(self, direction: str, seconds: float, blocks: int) -> None:
        self.data[f"{direction}_seconds"].append(seconds)
        self.data[f"{direction}_blocks"] += blocks

    def aggregate(self, other: KVConnectorStats) -> KVBranchTransferStats:
        for key in ("load_seconds", "save_seconds"):
            self.data[key].extend(other.data.get(key, []))
        for key in ("load_blocks", "save_blocks"):
            self.data[key] += other.data.get(key, 0)
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {}
        for direction in ("load", "save"):
            times = self.data[f"{direction}_seconds"]
            out[f"{direction}_blocks"] = self.data[f"{direction}_blocks"]
            out[f"{direction}_avg_ms"] = round(1000 * sum(times) / len(times), 3) if times else 0
        return out

    def is_empty(self) -> bool:
        return not (self.data["load_seconds"] or self.data["save_seconds"])


class KVBranchPromMetrics(KVConnectorPromMetrics):
    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict,
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        histogram = self._histogram_cls(
            name="kvbranch_host_copy_seconds",
            documentation="Time of one step's block copies between the KV cache and the "
            "kvbranch host store",
            labelnames=labelnames + ["direction"],
            buckets=BUCKETS,
        )
        blocks = self._counter_cls(
            name="kvbranch_host_copied_blocks",
            documentation="Blocks copied between the KV cache and the kvbranch host store",
            labelnames=labelnames + ["direction"],
        )
        self._seconds = {}
        self._blocks = {}
        for engine, values in per_engine_labelvalues.items():
            for direction in ("load", "save"):
                self._seconds[(engine, direction)] = histogram.labels(*values, direction)
                self._blocks[(engine, direction)] = blocks.labels(*values, direction)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for direction in ("load", "save"):
            hist = self._seconds.get((engine_idx, direction))
            if hist is None:
                continue
            for seconds in transfer_stats_data.get(f"{direction}_seconds", []):
                hist.observe(seconds)
            count = transfer_stats_data.get(f"{direction}_blocks", 0)
            if count:
                self._blocks[(engine_idx, direction)].inc(count)
