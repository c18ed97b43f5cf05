"""Worker-side host memory for KV blocks, and the copies between it and the paged KV cache.

One host tensor per KV cache tensor of the engine, with the same shape except that the block
dimension has ``num_slots`` entries. Copies are whole blocks in both directions:

* CPU platform: batched ``index_select``/``index_copy_`` (the paged cache is host memory too);
* CUDA: the host tensors are pinned and slot-major (one contiguous host block per slot, so each
  copy is a true async memcpy), and copies run on a dedicated stream, one per (layer, block).
  Ordering, on the GPU, without stalling the host:

  - a save starts after the work already queued on the compute stream (the forward that
    computed its blocks), and the compute stream then waits for the save: whatever the next
    step writes into a freed block (zeroing, copy-on-write, the forward) runs after the copy,
    in every runner and scheduling mode (no connector hook runs before model runner V2 zeroes
    new blocks, so the order has to be set up by the save itself);
  - a load starts after the compute stream's queued work (this step's block zeroing) and
    after earlier saves on the same stream (a slot saved last step may be loaded now), and the
    forward waits for it.

  :meth:`HostKVPool.fence` is the host-side wait, for writers outside any CUDA stream (a peer
  connector's pull, in P/D).

On CPU, with ``async_saves`` (the default; ``KVBRANCH_ASYNC_SAVE=0`` turns it off), a save
runs in one background thread and the step returns at once: its first token is not held back
by the copy, which on these VMs is mostly first-touch page faults of the host store
(measured: 6 blocks into never-used slots 32-150 ms, into used slots 7-23 ms, at load 5-9);
the turn-1 A/B of docs/scheduling.md is why it is the default. :meth:`fence` joins
it; the worker fences at the start of every step (``fence_for``, before vLLM's model runner
V1 zeroes new blocks or the forward writes any), and a load or the next save joins first, so
no block is rewritten or read while a save still reads or writes it.

Pre-faulting (CPU): the host tensors come from ``torch.empty``, so each never-used slot costs
page faults the first time a save writes it — on a fresh server, in every turn 1. A background
thread at the lowest priority asks the kernel to populate the whole store writable
(``madvise(MADV_POPULATE_WRITE)``, Linux >= 5.14), which maps zeroed pages without changing a
byte already written, so it needs no ordering with saves or loads. That is what the CUDA branch
gets from pinning (pinned memory is resident from the start), and what a server that has run a
while has anyway: the store's resident size is its configured size. ``KVBRANCH_PREFAULT=0`` turns
it off (the memory is then touched as saves reach it).

The CUDA branch is deliberately thin; the block planning that decides *what* to copy is shared
and covered by the CPU tests.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from server.common.env import on_unless_zero
from server.connector.core.metadata import SKIPPED, HostSlots, device_block, group_slot

#: ``0``: CPU saves in the step, on its critical path; anything else or unset: in a background
#: thread (see the module docstring; docs/scheduling.md has the turn-1 measurement).
ENV_ASYNC_SAVE = "KVBRANCH_ASYNC_SAVE"


#: ``0``: do not pre-fault the CPU host store (see the module docstring).
ENV_PREFAULT = "KVBRANCH_PREFAULT"
#: ``madvise`` advice that populates pages writable without touching their contents (Linux 5.14).
MADV_POPULATE_WRITE = 23
#: Populated per call: small enough that a lower-priority thread yields the core often.
PREFAULT_CHUNK_BYTES = 32 << 20

logger = logging.getLogger("kvbranch.connector")


def async_saves_from_env() -> bool:
    return on_unless_zero(ENV_ASYNC_SAVE)


def prefault_from_env() -> bool:
    return on_unless_zero(ENV_PREFAULT)


def populate_writable(tensors: Sequence[torch.Tensor]) -> int:
    """Populate the pages of CPU ``tensors`` writable, contents unchanged; the bytes populated.

    Stops (leaving the rest to be faulted on first write) where the kernel does not support the
    advice."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    page = mmap.PAGESIZE
    done = 0
    for tensor in tensors:
        start = -(-tensor.data_ptr() // page) * page
        end = (tensor.data_ptr() + tensor.numel() * tensor.element_size()) // page * page
        for addr in range(start, end, PREFAULT_CHUNK_BYTES):
            length = min(PREFAULT_CHUNK_BYTES, end - addr)
            if libc.madvise(addr, length, MADV_POPULATE_WRITE) != 0:
                err = ctypes.get_errno()
                logger.info(
                    "host store not pre-faulted (%s): first saves fault it in", os.strerror(err)
                )
                return done
            done += length
    return done


def find_block_dim(shape: Sequence[int], num_blocks: int) -> int:
    """The dimension of a paged KV tensor that indexes blocks.

    vLLM backends lay blocks out first (CPU: ``[blocks, heads, block_size, 2*head]``) or second
    (``[2, blocks, ...]``); we pick the first dimension whose size is ``num_blocks`` and prefer
    dimension 0, then 1.
    """
    for dim in (0, 1):
        if dim < len(shape) and shape[dim] == num_blocks:
            return dim
    for dim, size in enumerate(shape):
        if size == num_blocks:
            return dim
    raise ValueError(f"no dimension of size {num_blocks} in KV cache shape {tuple(shape)}")


def group_caches(
    kv_caches: dict[str, torch.Tensor], groups: Sequence[Sequence[str]] | None
) -> dict[tuple[int, str], torch.Tensor]:
    """The KV tensors a slot copies, keyed by (KV cache group, layer): each group's layers,
    each storage once within a group (layers may share one tensor: cross-layer KV sharing).

    Under vLLM's hybrid KV cache manager the layers of different groups share one tensor
    (layer *i* of every group), each group addressing its own blocks of it: such a tensor is
    listed once per group, since a slot holds that position's block of every group. Without
    ``groups``, all layers are one group."""
    layer_groups = [list(kv_caches)] if not groups else [list(g) for g in groups]
    out: dict[tuple[int, str], torch.Tensor] = {}
    for g, names in enumerate(layer_groups):
        seen: set[int] = set()
        for name in names:
            tensor = kv_caches.get(name)
            if not isinstance(tensor, torch.Tensor) or tensor.data_ptr() in seen:
                continue
            seen.add(tensor.data_ptr())
            out[(g, name)] = tensor
    return out


def group_pairs(
    blocks: Sequence[int | Sequence[int]], slots: Sequence[HostSlots], group: int
) -> tuple[list[int], list[int]]:
    """(device blocks, slots) of one group: the positions where that group holds a block and
    has a host slot."""
    src: list[int] = []
    dst: list[int] = []
    for block, slot in zip(blocks, slots, strict=True):
        block_id = device_block(block)[group]
        slot_id = group_slot(slot, group)
        if block_id != SKIPPED and slot_id != SKIPPED:
            src.append(block_id)
            dst.append(slot_id)
    return src, dst


class HostKVPool:
    """Host copies of KV blocks, addressed by slot: one slot is one block position of every
    KV cache group (every layer), except the ``pools``' groups (windowed groups, state groups),
    whose tensors have as many entries as their pool has part slots (``core/part_pool.py``): a
    copy then names a slot per group (:data:`~server.connector.core.metadata.HostSlots`)."""

    def __init__(
        self,
        kv_caches: dict[str, torch.Tensor],
        num_blocks: int,
        num_slots: int,
        async_saves: bool = False,
        prefault: bool = False,
        groups: Sequence[Sequence[str]] | None = None,
        pools: Sequence[tuple[frozenset[int], int]] = (),
    ) -> None:
        self.num_slots = num_slots
        #: Part slots of each group in a pool (``(groups, part slots)`` each).
        self.pool_slots = {g: n for groups, n in pools for g in groups}
        self.device_caches = group_caches(kv_caches, groups)
        self.num_groups = 1 + max(g for g, _ in self.device_caches)
        first = next(iter(self.device_caches.values()))
        self.device = first.device
        self.cuda = first.is_cuda
        self.block_dims: dict[tuple[int, str], int] = {}
        self.host_dims: dict[tuple[int, str], int] = {}
        self.host_caches: dict[tuple[int, str], torch.Tensor] = {}
        for name, tensor in self.device_caches.items():
            dim = find_block_dim(tensor.shape, num_blocks)
            shape = list(tensor.shape)
            slots = self.pool_slots.get(name[0], num_slots)
            if self.cuda:
                # Slot-major: a block of a [2, blocks, ...] cache is not contiguous, and a copy
                # into a non-contiguous pinned view goes through a pageable temporary (a
                # synchronous memcpy). One contiguous host block per slot avoids that.
                shape = [slots] + shape[:dim] + shape[dim + 1 :]
                self.host_dims[name] = 0
            else:
                shape[dim] = slots
                self.host_dims[name] = dim
            self.block_dims[name] = dim
            self.host_caches[name] = torch.empty(
                shape, dtype=tensor.dtype, device="cpu", pin_memory=self.cuda
            )
        per_block = {
            n: t.element_size() * t.numel() // max(t.shape[self.block_dims[n]], 1)
            for n, t in self.device_caches.items()
        }
        #: Bytes of one slot (every group outside the pools) and of one part of each pool.
        self.block_bytes = sum(b for n, b in per_block.items() if n[0] not in self.pool_slots)
        self.part_bytes = [
            sum(b for n, b in per_block.items() if n[0] in groups) for groups, _ in pools
        ]
        self._stream = torch.cuda.Stream(device=self.device) if self.cuda else None
        self._pending_save: torch.cuda.Event | None = None
        #: CPU async saves: one thread, at most one save in flight.
        self.async_cpu = async_saves and not self.cuda
        self._saver = (
            ThreadPoolExecutor(1, thread_name_prefix="kvbranch-save") if self.async_cpu else None
        )
        self._pending_cpu: Future[None] | None = None
        #: CPU pre-fault of the whole store (module docstring); ``None`` when not started.
        self.prefault_thread: threading.Thread | None = None
        self.prefaulted_bytes = 0
        if prefault and not self.cuda:
            self.prefault_thread = threading.Thread(
                target=self._prefault, name="kvbranch-prefault", daemon=True
            )
            self.prefault_thread.start()

    def _prefault(self) -> None:
        """The pre-fault thread: at the lowest scheduling priority (this thread only), so the
        engine's own threads go first."""
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except (AttributeError, OSError):
            pass
        t0 = time.monotonic()
        self.prefaulted_bytes = populate_writable(list(self.host_caches.values()))
        if self.prefaulted_bytes:
            logger.info(
                "kvbranch: host store pre-faulted, %.2f GiB in %.1f s",
                self.prefaulted_bytes / 2**30,
                time.monotonic() - t0,
            )

    # --- device -> host ----------------------------------------------------------------------
    def save(self, block_ids: Sequence[int | Sequence[int]], slots: Sequence[HostSlots]) -> None:
        if self._saver is not None and block_ids:
            self.fence()  # saves in order, one at a time
            src, dst = list(block_ids), list(slots)
            self._pending_cpu = self._saver.submit(self._copy, src, dst, to_host=True)
            return
        self._copy(block_ids, slots, to_host=True)

    def _copy(self, src: Sequence[Any], dst: Sequence[Any], *, to_host: bool) -> None:
        """Copy blocks ``src`` to ``dst``: device blocks to host slots (``to_host``, a save) or
        host slots to device blocks (a load). A device block is an id (one group) or one id
        per group, :data:`~server.connector.core.metadata.SKIPPED` where a group has none."""
        if not src:
            return
        blocks, slots = (src, dst) if to_host else (dst, src)
        per_group = [group_pairs(blocks, slots, g) for g in range(self.num_groups)]
        if self.cuda:
            (self._save_cuda if to_host else self._load_cuda)(per_group)
            return
        index = [
            (torch.tensor(b, dtype=torch.long), torch.tensor(s, dtype=torch.long))
            for b, s in per_group
        ]
        for key, dev in self.device_caches.items():
            block_idx, slot_idx = index[key[0]]
            if not len(block_idx):
                continue
            dim, host = self.block_dims[key], self.host_caches[key]
            if to_host:
                host.index_copy_(dim, slot_idx, dev.index_select(dim, block_idx))
            else:
                dev.index_copy_(dim, block_idx, host.index_select(dim, slot_idx))

    def _save_cuda(self, per_group: list[tuple[list[int], list[int]]]) -> None:
        assert self._stream is not None
        compute = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(compute)  # after the forward that computed these blocks
        with torch.cuda.stream(self._stream):
            for key, dev in self.device_caches.items():
                dim, host = self.block_dims[key], self.host_caches[key]
                for block, slot in zip(*per_group[key[0]], strict=True):
                    host[slot].copy_(dev.select(dim, block), non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._stream)
        # The save fence: nothing queued on the compute stream from now on (the next step's
        # block zeroing, copy-on-write copies, forward) can overwrite a block being saved.
        compute.wait_event(event)
        self._pending_save = event

    # --- host -> device ----------------------------------------------------------------------
    def load(self, slots: Sequence[HostSlots], block_ids: Sequence[int | Sequence[int]]) -> None:
        self.fence()  # CPU async: a pending save may still write the slots read here
        self._copy(slots, block_ids, to_host=False)

    def _load_cuda(self, per_group: list[tuple[list[int], list[int]]]) -> None:
        assert self._stream is not None
        compute = torch.cuda.current_stream(self.device)
        # After this step's zeroing of freshly allocated blocks (queued on the compute stream):
        # a zero landing after the load would wipe the loaded KV.
        self._stream.wait_stream(compute)
        with torch.cuda.stream(self._stream):
            for key, dev in self.device_caches.items():
                dim, host = self.block_dims[key], self.host_caches[key]
                for block, slot in zip(*per_group[key[0]], strict=True):
                    dev.select(dim, block).copy_(host[slot], non_blocking=True)
        # The forward that reads these blocks runs on the compute stream right after.
        compute.wait_stream(self._stream)

    def fence(self) -> None:
        """Wait on the host for the last save: needed before KV writes that no CUDA stream
        orders (a peer connector's pull); the compute stream is already ordered by ``save``.
        CPU async saves: wait for the save in flight (its error, if any, is raised here)."""
        if self._pending_cpu is not None:
            pending, self._pending_cpu = self._pending_cpu, None
            pending.result()
        if self._pending_save is not None:
            self._pending_save.synchronize()
            self._pending_save = None
