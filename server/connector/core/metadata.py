"""What the scheduler side tells the worker side each step (pickled across processes).

A plain dataclass (this layer imports no vLLM): the engine adapter registers it as a virtual
subclass of vLLM's ``KVConnectorMetadata`` (an ABC with no members).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class KVBranchMetadata:
    #: Host slot -> device block copies to run before this step's forward.
    load_slots: list[int] = field(default_factory=list)
    load_blocks: list[int] = field(default_factory=list)
    #: Device block -> host slot copies to run after this step's forward.
    save_blocks: list[int] = field(default_factory=list)
    save_slots: list[int] = field(default_factory=list)
    #: A peer connector (NIXL, in P/D) writes KV blocks this step outside any CUDA stream: the
    #: worker waits on the host for its pending save before the step touches KV.
    host_fence: bool = False
    #: Finished requests whose blocks vLLM keeps until their tail is copied out (the copy is
    #: among this step's saves, or got no slot): reported back through ``get_finished``.
    finished_saves: list[str] = field(default_factory=list)
