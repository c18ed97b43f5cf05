"""P/D: vLLM's NIXL transport composed with the kvbranch connector, split by job.

* ``connector``      — ``KVBranchPDConnector``: the ``MultiConnector`` composition, the
  by-name registration
* ``verified_nixl``  — ``VerifiedNixlConnector``: upstream NIXL with checked handles
* ``transfer_auth``  — sealed, claimed, single-use handles (pure)
* ``transfer_params`` — the params' allow-list, identity, verified token prefix (pure)
* ``hold_registry``  — D's holds of finished turns' blocks, claims (pure)
* ``read_bounds``    — reads never queued or in flight too long
* ``side_channel``   — NIXL's handshake listener and requester: authenticated, unkillable

``server.connector.pd`` is the module path users' vLLM configs and our launcher name
(``settings.PD_CONNECTOR_MODULE``): ``KVBranchPDConnector`` and ``VerifiedNixlConnector`` are
resolved from here on first access (PEP 562), so importing a pure part (the router imports
``transfer_auth``) does not import vLLM's NIXL connector.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from server.connector.pd.connector import KVBranchPDConnector
    from server.connector.pd.verified_nixl import VerifiedNixlConnector

__all__ = ["KVBranchPDConnector", "VerifiedNixlConnector"]

_LAZY = {
    "KVBranchPDConnector": "server.connector.pd.connector",
    "VerifiedNixlConnector": "server.connector.pd.verified_nixl",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    # The facade module registers the connectors by name on import (MultiConnector needs it).
    importlib.import_module("server.connector.pd.connector")
    return getattr(importlib.import_module(module), name)
