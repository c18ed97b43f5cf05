"""What the scheduler side tells the worker side each step (pickled across processes).

A plain dataclass (this layer imports no vLLM): the engine adapter registers it as a virtual
subclass of vLLM's ``KVConnectorMetadata`` (an ABC with no members).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

#: One block position of a request on the device: its block id in each KV cache group, in
#: group order (one id without vLLM's hybrid KV cache manager).
DeviceBlock = tuple[int, ...]

#: In a :data:`DeviceBlock`, a group that keeps no block at that position (vLLM's null block:
#: a sliding window left it behind). A load skips that group; such a position is never saved.
SKIPPED = -1


#: Where one block position lives in the host store: one slot for every group, or one per
#: group (a windowed group's part has a pool of its own, ``core/part_pool.py``), with
#: :data:`SKIPPED` where a group's part is not copied.
HostSlots = int | tuple[int, ...]


def group_slot(slots: HostSlots, group: int) -> int:
    """The host slot of ``group`` in ``slots``."""
    return slots if isinstance(slots, int) else slots[group]


def device_block(ids: int | Sequence[int]) -> DeviceBlock:
    """One block id (a single KV cache group) or one per group, as a :data:`DeviceBlock`."""
    return (ids,) if isinstance(ids, int) else tuple(ids)


def device_blocks(groups: Sequence[Sequence[int]], null_block: int = 0) -> list[DeviceBlock]:
    """vLLM's block table of a request (a list of block ids per KV cache group) as one
    :data:`DeviceBlock` per position, its null blocks as :data:`SKIPPED`. As long as the
    shortest group's table (vLLM pads every group to the same length)."""
    return [
        tuple(SKIPPED if block == null_block else block for block in position)
        for position in zip(*groups, strict=False)
    ]


def whole(block: DeviceBlock) -> bool:
    """Whether every group holds this position (it can be saved)."""
    return SKIPPED not in block


@dataclass
class KVBranchMetadata:
    #: Host slot -> device block copies to run before this step's forward.
    load_slots: list[HostSlots] = field(default_factory=list)
    load_blocks: list[DeviceBlock] = field(default_factory=list)
    #: Device block -> host slot copies to run after this step's forward.
    save_blocks: list[DeviceBlock] = field(default_factory=list)
    save_slots: list[HostSlots] = field(default_factory=list)
    #: A peer connector (NIXL, in P/D) writes KV blocks this step outside any CUDA stream: the
    #: worker waits on the host for its pending save before the step touches KV.
    host_fence: bool = False
    #: Finished requests whose blocks vLLM keeps until their tail is copied out (the copy is
    #: among this step's saves, or got no slot): reported back through ``get_finished``.
    finished_saves: list[str] = field(default_factory=list)
