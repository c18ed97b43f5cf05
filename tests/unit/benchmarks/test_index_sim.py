"""benchmarks/history/index_sim.py at a tiny size on the embedded backend: the structural facts hold
(no hold taken twice, nothing aimed at a killed instance once its heartbeat expired, index
routing beats round robin)."""

from __future__ import annotations

import asyncio

from benchmarks.history.index_sim import SimConfig, per_second, run_all, table, targets


def test_tiny_simulation_on_the_memory_backend():
    cfg = SimConfig(
        instances=10,
        sessions=100,
        turns=500,
        routers=(2,),
        backends=("memory",),
        cache_blocks=100,
        host_blocks=100,
        heartbeat_s=0.2,
        heartbeat_ttl_s=1.0,
        tail_s=0.1,
    )
    stats = asyncio.run(run_all(cfg))
    by = {s.name: s for s in stats}
    rr, one, cluster = by["round robin"], by["embedded, 1 router"], by["memory, 2 routers"]
    for s in stats:
        assert s.taken_twice == 0
        assert all(age <= cfg.heartbeat_ttl_s for age in s.dead_after_kill)
    assert cluster.dups > 0 and cluster.holds_taken > 0 and cluster.pulls > 0
    assert cluster.hit_rate > rr.hit_rate
    assert one.hit_rate > rr.hit_rate
    assert cluster.hit_rate <= cluster.oracle_rate
    assert len(cluster.latencies_ms) >= cluster.turns
    assert "memory, 2 routers" in table(stats)
    assert any(t.what == "0 holds taken twice" and t.met for t in targets(cfg, stats))


def test_per_second_buckets():
    assert per_second([]) == []
    assert per_second([0.1, 0.5, 2.2]) == [2, 0, 1]
