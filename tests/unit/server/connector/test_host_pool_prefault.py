"""The CPU host store is pre-faulted in the background (KVBRANCH_PREFAULT=0 turns it off): its
pages become resident and writable without a byte of what saves wrote changing."""

from __future__ import annotations

import ctypes
import mmap
import platform
import re

import pytest
import torch

from server.connector.engine.host_pool import (
    ENV_PREFAULT,
    HostKVPool,
    populate_writable,
    prefault_from_env,
)


def resident_pages(tensor: torch.Tensor) -> tuple[int, int]:
    """(resident, total) pages of the whole pages inside ``tensor``'s memory (mincore)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    page = mmap.PAGESIZE
    start = -(-tensor.data_ptr() // page) * page
    end = (tensor.data_ptr() + tensor.numel() * tensor.element_size()) // page * page
    pages = (end - start) // page
    vec = ctypes.create_string_buffer(pages)
    assert libc.mincore(start, end - start, vec) == 0, ctypes.get_errno()
    return sum(b & 1 for b in vec.raw), pages


def fresh_tensor(nbytes: int) -> tuple[mmap.mmap, torch.Tensor]:
    """A tensor over a new anonymous mapping: no page touched yet (``torch.empty`` may reuse
    memory the process already touched)."""
    mm = mmap.mmap(-1, nbytes)
    return mm, torch.frombuffer(mm, dtype=torch.uint8)


def populate_supported() -> bool:
    """Whether the kernel has MADV_POPULATE_WRITE (Linux 5.14), read from its release, not from
    the function under test: a ``populate_writable`` that did nothing would otherwise skip its
    own tests."""
    if platform.system() != "Linux":
        return False
    release = re.match(r"(\d+)\.(\d+)", platform.release())
    return release is not None and (int(release[1]), int(release[2])) >= (5, 14)


needs_populate = pytest.mark.skipif(
    not populate_supported(), reason="the kernel does not support MADV_POPULATE_WRITE"
)


@needs_populate
def test_populate_makes_pages_resident_and_keeps_contents():
    mm, t = fresh_tensor(16 << 20)
    before, pages = resident_pages(t)
    assert before == 0
    t[: 1 << 20] = 7  # written before: must survive
    assert populate_writable([t]) >= (pages - 1) * mmap.PAGESIZE
    after, _ = resident_pages(t)
    assert after == pages
    assert bool((t[: 1 << 20] == 7).all()) and bool((t[1 << 20 :] == 0).all())
    del t
    mm.close()


@needs_populate
def test_pool_prefaults_in_the_background_and_saves_stay_exact():
    g = torch.Generator().manual_seed(0)
    kv = {f"l{i}": torch.randn(4, 2, 8, 1024, generator=g) for i in range(2)}  # 32 KiB blocks
    pool = HostKVPool(kv, 4, 256, async_saves=True, prefault=True)  # 8 MiB per layer
    pool.save([1, 3], [0, 255])  # may run while the pre-fault does: no ordering needed
    assert pool.prefault_thread is not None
    pool.prefault_thread.join(30)
    pool.fence()
    assert pool.prefaulted_bytes > 0
    for (_, name), host in pool.host_caches.items():
        assert torch.equal(host.select(0, 0), kv[name].select(0, 1))
        assert torch.equal(host.select(0, 255), kv[name].select(0, 3))
        resident, pages = resident_pages(host)
        assert resident == pages


def test_prefault_is_off_unless_asked(monkeypatch):
    kv = {"l0": torch.zeros(4, 2, 8, 16)}
    assert HostKVPool(kv, 4, 8).prefault_thread is None
    monkeypatch.delenv(ENV_PREFAULT, raising=False)
    assert prefault_from_env()
    monkeypatch.setenv(ENV_PREFAULT, "0")
    assert not prefault_from_env()
