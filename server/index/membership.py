"""The index's membership role: which instances are up, as each describes itself.

Each instance writes its own record only (URL, role, model, block size, NIXL side channel,
load) under its identity, refreshed by a heartbeat with a TTL and sealed with the cluster
secret. It is the one thing routers read from the index that decides where traffic goes, so a
record whose seal fails is never listed (:mod:`server.index.record_seal`).
"""

from __future__ import annotations

import abc
import time
from dataclasses import dataclass, field
from typing import Literal

from server.index.base import IndexBackend

Role = Literal["prefill", "decode", "both"]

#: An instance's record expires this long after its last heartbeat: then no router picks it.
DEFAULT_HEARTBEAT_TTL_S = 10.0


@dataclass
class InstanceRecord:
    """One instance, as it describes itself in its heartbeat."""

    instance_id: str
    url: str
    role: Role
    model: str = ""
    block_size: int = 0
    #: NIXL side channel (host:port) for P/D pulls, "" when the instance has none.
    nixl: str = ""
    #: Generation of its device-tier block entries: entries stamped with another are invisible.
    generation: int = 0
    #: The same for its host-store tier (bumped apart: a device reset keeps the host store).
    host_generation: int = 0
    #: Requests in flight (running + waiting) at the last heartbeat.
    load: int = 0
    #: Device KV cache use in [0, 1] at the last heartbeat.
    kv_usage: float = 0.0
    #: Data-parallel engines behind this URL.
    engines: int = 1
    started_at: float = field(default_factory=time.time)
    #: The instance's seal over every field above (:mod:`server.index.record_seal`): routers
    #: list only records whose seal verifies under the cluster secret.
    mac: str = ""


def member_id(instance_id: str, engine: int, engines: int) -> str:
    """The index identity of data-parallel engine ``engine`` of the ``engines`` behind one API
    server (each engine core has its own connector, host store and NIXL side channel, so each
    is a member); the instance's own id with a single engine."""
    return instance_id if engines <= 1 else f"{instance_id}-dp{engine}"


def generation_of(record: InstanceRecord, tier: str) -> int:
    """The generation ``record``'s entries of ``tier`` ("device" or "host") are stamped with."""
    return record.host_generation if tier == "host" else record.generation


class Membership(IndexBackend):
    """The live instances: each registers and refreshes itself, routers list them."""

    @abc.abstractmethod
    async def heartbeat(self, record: InstanceRecord, ttl_s: float) -> None:
        """Register or refresh ``record``; it disappears ``ttl_s`` after the last heartbeat."""

    @abc.abstractmethod
    async def deregister(self, instance_id: str) -> None:
        """Leave the cluster now (a clean shutdown)."""

    @abc.abstractmethod
    async def members(self) -> list[InstanceRecord]:
        """The instances whose heartbeat has not expired."""
