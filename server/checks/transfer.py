"""Transfer params in a client's request: where vLLM would find them, and the router's refusal.

vLLM acts on ``kv_transfer_params`` from the body's field and from the extension args (it copies
the field into them, and its connectors read them from there), so a client can set them either
way. Set by a client they would make an instance pull from, or hold its blocks for, a peer the
client names. Each instance's guard accepts them only on a request the P/D router signed
(:mod:`server.plugin.cluster_gate`); the router itself never relays a client's, in either place
and in either topology (P/D, aggregated replicas), so such a request is refused at the edge
before any instance sees it.
"""

from __future__ import annotations

from typing import Any

from sdk.contract import (
    EXTRA_ARGS_FIELD,
    NESTED_XARGS_PATH,
    SAMPLING_PARAMS_FIELD,
    TRANSFER_PARAMS_FIELD,
    XARGS_FIELD,
)

__all__ = ["transfer_fields", "transfer_problem"]


def transfer_fields(payload: dict[str, Any], path: str) -> list[str]:
    """Where this body carries transfer params (``null`` counts as none)."""
    found = []
    if payload.get(TRANSFER_PARAMS_FIELD) is not None:
        found.append(TRANSFER_PARAMS_FIELD)
    if path == NESTED_XARGS_PATH:
        params = payload.get(SAMPLING_PARAMS_FIELD)
        xargs = params.get(EXTRA_ARGS_FIELD) if isinstance(params, dict) else None
        where = f"{SAMPLING_PARAMS_FIELD}.{EXTRA_ARGS_FIELD}"
    else:
        xargs = payload.get(XARGS_FIELD)
        where = XARGS_FIELD
    if isinstance(xargs, dict) and TRANSFER_PARAMS_FIELD in xargs:
        found.append(f"{where}.{TRANSFER_PARAMS_FIELD}")
    return found


def transfer_problem(payload: dict[str, Any], path: str) -> tuple[str, str] | None:
    """``(param, message)`` when a client's turn names transfer params anywhere — the field
    itself even when ``null`` (the router sets it on its own legs) — else None."""
    fields = transfer_fields(payload, path)
    if TRANSFER_PARAMS_FIELD in payload and TRANSFER_PARAMS_FIELD not in fields:
        fields.insert(0, TRANSFER_PARAMS_FIELD)
    if not fields:
        return None
    return fields[0], f"{fields[0]} is set by the cluster, never by a client; remove it"
