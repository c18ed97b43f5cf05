"""The environment the launcher hands every process it starts (vLLM's API server, its engine
core, the router), and how those processes read a switch from it.

The launcher writes these variables (:mod:`server.launcher.settings` has its flags); the plugin, the
engine's scheduler, the connector and the index publisher read them. Its own module so that
those readers, which run in other processes, import neither the launcher nor one another.
Standard library only.
"""

from __future__ import annotations

import os

ENV_CONTROL_SOCKET = "KVBRANCH_CONTROL_SOCKET"
ENV_API_KEYS = "KVBRANCH_API_KEYS"
ENV_MODEL_NAME = "KVBRANCH_MODEL_NAME"
ENV_ROLE = "KVBRANCH_ROLE"
#: ``--data-parallel-size`` after ``--`` (set when above 1): vLLM resets it to 1 inside each
#: engine core of a dense model, whose connector needs the count (server.common.engine_choice).
ENV_DATA_PARALLEL_SIZE = "KVBRANCH_DATA_PARALLEL_SIZE"
#: The cluster index an instance publishes into (``--index``; unset or "memory": none).
ENV_INDEX_URL = "KVBRANCH_INDEX_URL"
ENV_CLUSTER_NAME = "KVBRANCH_CLUSTER_NAME"
#: The URL routers reach this instance at (``--advertise-url``), as its heartbeat says.
ENV_ADVERTISE_URL = "KVBRANCH_ADVERTISE_URL"
#: vLLM's NIXL side channel as the launcher gives it to vLLM: the host, and the port of
#: data-parallel engine 0 (vLLM offsets it by the engine's rank: engine ``i`` listens on it + i).
ENV_NIXL_HOST = "VLLM_NIXL_SIDE_CHANNEL_HOST"
ENV_NIXL_PORT = "VLLM_NIXL_SIDE_CHANNEL_PORT"
#: ``1``: an aggregated replica (``--role single`` with a shared index): the plugin takes each
#: session turn's hold from the index, pulls from the peer holding it, and files the new hold.
ENV_PEER_PULL = "KVBRANCH_PEER_PULL"
#: Agent-aware priority's aging in seconds (``--agent-priority``; unset: the policy is off).
ENV_PRIORITY_AGING_S = "KVBRANCH_PRIORITY_AGING_S"
#: ``0``: the warm-first scheduler does not backfill (server/engine/scheduler.py; for A/B runs).
ENV_BACKFILL = "KVBRANCH_BACKFILL"
#: ``0``: the warm-first scheduler does not pause cold prefills for a resumed turn's step
#: (server/engine/scheduler.py; for A/B runs).
ENV_PAUSE_COLDS = "KVBRANCH_PAUSE_COLDS"
#: ``0``: the warm-first scheduler batches a burst of resumed turns into one step instead of
#: running them in rank order in short steps (server/engine/scheduler.py; for A/B runs).
ENV_SPLIT_BURSTS = "KVBRANCH_SPLIT_BURSTS"


def on_unless_zero(name: str) -> bool:
    """A switch that is on by default: ``NAME=0`` in the environment turns it off (A/B runs)."""
    return os.environ.get(name, "").strip() != "0"


def nixl_side_channel_port() -> int | None:
    """The NIXL side-channel port of data-parallel engine 0 (:data:`ENV_NIXL_PORT`); None
    when the launcher gave vLLM none."""
    port = os.environ.get(ENV_NIXL_PORT, "")
    return int(port) if port.isdigit() else None
