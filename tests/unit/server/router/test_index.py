"""The cluster index: capped (oldest evicted), swept (expired entries counted)."""

from __future__ import annotations

import time

import pytest

from server.router.index import ClusterIndex
from tests.unit.server.router.fakes import D


def test_index_cap_evicts_the_oldest_entry():
    index = ClusterIndex(ttl_s=60, max_entries=3)
    for i in range(3):
        index.put(("t", f"s{i}", "main"), D, "x", {"remote_num_tokens": i})
    index.put(("t", "s0", "main"), D, "x", {"remote_num_tokens": 9})  # s0 is now the youngest
    index.put(("t", "s3", "main"), D, "x", {"remote_num_tokens": 3})
    assert len(index) == 3
    assert index.peek(("t", "s1", "main")) is None  # the oldest went
    assert index.peek(("t", "s0", "main")).num_tokens == 9
    assert index.counters()["evicted"] == 1
    with pytest.raises(ValueError):
        ClusterIndex(ttl_s=1, max_entries=0)


def test_index_sweep_counts_what_it_dropped():
    index = ClusterIndex(ttl_s=0.01)
    index.put(("t", "a", "main"), D, "x", {})
    index.put(("t", "b", "main"), D, "x", {})
    time.sleep(0.03)
    assert index.sweep() == 2 and len(index) == 0 and index.counters()["expired"] == 2
