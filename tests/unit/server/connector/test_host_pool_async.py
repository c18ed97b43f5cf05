"""HostKVPool on CPU with async saves (the default; KVBRANCH_ASYNC_SAVE=0 turns them off): the
same copies as the synchronous pool, joined by fence, by the next save and by any load."""

from __future__ import annotations

import threading

import torch

from server.connector.core.metadata import KVBranchMetadata
from server.connector.engine import host_pool as host_pool_module
from server.connector.engine.host_pool import ENV_ASYNC_SAVE, HostKVPool, async_saves_from_env
from server.connector.engine.worker_side import KVBranchWorker


def caches(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"l{i}": torch.randn(2, 6, 4, 2, 3, generator=g) for i in range(3)}


def test_async_save_matches_sync_after_fence():
    kv = caches()
    sync, asyn = HostKVPool(kv, 6, 4), HostKVPool(kv, 6, 4, async_saves=True)
    assert asyn.async_cpu and not sync.async_cpu
    sync.save([1, 4], [0, 3])
    asyn.save([1, 4], [0, 3])
    asyn.fence()
    for name in kv:  # the saved slots (the others are uninitialized memory)
        for slot in (0, 3):
            want = sync.host_caches[0, name].select(1, slot)
            assert torch.equal(want, asyn.host_caches[0, name].select(1, slot))


def test_load_and_next_save_wait_for_the_pending_save(monkeypatch):
    kv = caches()
    pool = HostKVPool(kv, 6, 4, async_saves=True)
    gate = threading.Event()
    copy = HostKVPool._copy

    def slow_copy(self, src, dst, *, to_host):
        if to_host:
            gate.wait(5)
        copy(self, src, dst, to_host=to_host)

    monkeypatch.setattr(HostKVPool, "_copy", slow_copy)
    want = {name: t.select(1, 2).clone() for name, t in kv.items()}
    pool.save([2], [1])
    assert pool._pending_cpu is not None and not pool._pending_cpu.done()
    threading.Timer(0.05, gate.set).start()
    for t in kv.values():
        t.select(1, 5).zero_()
    pool.load([1], [5])  # waits for the save, then reads the slot it wrote
    for name, t in kv.items():
        assert torch.equal(t.select(1, 5), want[name])
    assert pool._pending_cpu is None


def test_fence_raises_a_failed_save(monkeypatch):
    pool = HostKVPool(caches(), 6, 4, async_saves=True)

    def broken(self, src, dst, *, to_host):
        raise RuntimeError("copy failed")

    monkeypatch.setattr(HostKVPool, "_copy", broken)
    pool.save([0], [0])
    try:
        pool.fence()
    except RuntimeError as exc:
        assert "copy failed" in str(exc)
    else:  # pragma: no cover
        raise AssertionError("fence did not raise")


def test_worker_fences_every_step_with_async_saves(monkeypatch):
    monkeypatch.setenv(ENV_ASYNC_SAVE, "1")
    assert async_saves_from_env()
    worker = KVBranchWorker(num_slots=4, block_bytes=0)
    worker.register_kv_caches(caches(), 6)
    assert worker.pool is not None and worker.pool.async_cpu
    calls = []
    monkeypatch.setattr(worker.pool, "fence", lambda: calls.append(1))
    worker.fence_for(KVBranchMetadata())
    assert calls == [1]
    monkeypatch.delenv(ENV_ASYNC_SAVE)
    assert host_pool_module.async_saves_from_env()  # the default
    monkeypatch.setenv(ENV_ASYNC_SAVE, "0")
    assert not host_pool_module.async_saves_from_env()
