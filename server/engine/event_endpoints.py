"""Each data-parallel engine's KV-event sockets on ``ipc://`` (a vLLM general plugin).

vLLM gives every data-parallel engine its own KV-event endpoints by offsetting the configured
ones by the engine's rank (``ZmqEventPublisher.offset_endpoint_port``): a ``tcp://`` port plus
the rank, an ``inproc://`` name plus ``_dp<rank>``; any other endpoint raises ``ValueError`` at
ranks past 0, so the engine core does not start. The launcher's endpoints are ``ipc://``
sockets in the instance's private run directory (a KV-event socket carries every tenant's
token ids and has no authentication: docs/security.md), and a loopback ``tcp://`` port instead
would be open to every local user. :func:`install` gives an ``ipc://`` endpoint the suffix vLLM
gives an ``inproc://`` one, so engine ``i``'s sockets are ``<path>_dp<i>`` beside engine 0's,
with the directory's permissions.

Only the engine cores build publishers; the API server learns each engine's resolved endpoints
from the engine's handshake (vLLM's ``get_kv_event_sources``), so it needs nothing. Pinned to
vLLM 0.32's static ``offset_endpoint_port(endpoint, data_parallel_rank)``; on another shape
the plugin logs that it left vLLM unchanged.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from typing import Any

#: The general plugin's name (``pyproject.toml``; the launcher names it in ``VLLM_PLUGINS``).
PLUGIN_NAME = "kvbranch_event_endpoints"
#: The vLLM method this plugin wraps.
OFFSET = "vllm.distributed.kv_events.ZmqEventPublisher.offset_endpoint_port"
_MARK = "_kvbranch_ipc_suffix"

logger = logging.getLogger("kvbranch.event_endpoints")

Offset = Callable[[str | None, int], str | None]


def engine_endpoint(endpoint: str, rank: int) -> str:
    """Engine ``rank``'s socket for the ``ipc://`` ``endpoint`` the launcher configured (the
    name vLLM's engine binds once this plugin ran; the endpoint itself for engine 0)."""
    return f"{endpoint}_dp{rank}" if rank else endpoint


def ipc_suffixed(original: Offset) -> Offset:
    """``original`` (vLLM's offset) with ``ipc://`` endpoints suffixed by rank."""

    def offset_endpoint_port(endpoint: str | None, data_parallel_rank: int) -> str | None:
        if endpoint and endpoint.startswith("ipc://"):
            return engine_endpoint(endpoint, data_parallel_rank)
        return original(endpoint, data_parallel_rank)

    setattr(offset_endpoint_port, _MARK, True)
    offset_endpoint_port.__doc__ = original.__doc__
    offset_endpoint_port.__wrapped__ = original  # type: ignore[attr-defined]
    return offset_endpoint_port


def install() -> bool:
    """vLLM general-plugin entry point (every vLLM process, possibly more than once): wrap
    vLLM's offset once. Returns whether it is wrapped afterwards."""
    target, _, method = OFFSET.rpartition(".")
    module_name, _, class_name = target.rpartition(".")
    try:
        klass: Any = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError):
        logger.info("kvbranch: no vLLM %s here; KV-event endpoints unchanged", class_name)
        return False
    current = klass.__dict__.get(method)
    if not isinstance(current, staticmethod):
        logger.info("kvbranch: unexpected vLLM %s; KV-event endpoints unchanged", class_name)
        return False
    if getattr(current.__func__, _MARK, False):
        return True
    setattr(klass, method, staticmethod(ipc_suffixed(current.__func__)))
    return True
