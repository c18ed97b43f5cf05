"""What only the cluster may send an instance: transfer params, hold claims, and dev routes.

The guard (:mod:`server.plugin.guard`) asks this module before any of our layers or vLLM reads
a request:

* **Transfer params** (``kv_transfer_params`` in the body, or smuggled in the extension args,
  where vLLM would also find them) are accepted only on a request the P/D router signed
  (:mod:`server.common.cluster_auth`); a client's own get 403. The router refuses client params at
  its edge; this is the same rule for a client that reaches P or D directly.
* **Hold claims** (``POST /v1/kvbranch/holds/claim``) likewise: a claim keeps D's blocks from
  new work, so only the router may make one. **Revives** (``POST /v1/kvbranch/holds/revive``,
  an aggregated replica asking a peer to bring a branch back from its host store and hold it:
  engine work and held blocks) are signed the same way, by the asking replica.
* **Dev routes** (vLLM's ``VLLM_SERVER_DEV_MODE`` routes: ``/reset_prefix_cache``,
  ``/server_info``, ``/sleep``, ...) sit outside ``/v1``, where vLLM checks no key; with API keys
  they need one (401), as every generating route does. Without dev mode they do not exist.

Pure functions of the request (path, headers, body bytes, parsed payload) and the secret.
"""

from __future__ import annotations

import functools
from typing import Any

from server.common.cluster_auth import ROUTER_PROOF_HEADER, verify

__all__ = ["ROUTER_PROOF_HEADER", "claim_refusal", "from_router", "is_dev_path", "transfer_refusal"]
from sdk.contract import HOLD_CLAIM_PATH, TRANSFER_PARAMS_FIELD
from server.checks.transfer import transfer_fields
from server.plugin.revive_rules import REVIVE_PATH

#: Routes only a member of the cluster may call (the request signed with the cluster secret).
SIGNED_PATHS = frozenset((HOLD_CLAIM_PATH, REVIVE_PATH))

#: vLLM 0.32's dev-mode routes (``vllm/entrypoints/serve/dev`` and ``vllm/entrypoints/rl``,
#: registered only with ``VLLM_SERVER_DEV_MODE=1``); a test lists them from vLLM's own app.
DEV_PATHS = (
    "/abort_requests",
    "/collective_rpc",
    "/finish_weight_update",
    "/get_world_size",
    "/init_weight_transfer_engine",
    "/is_paused",
    "/is_sleeping",
    "/pause",
    "/release_kv_cache_memory",
    "/reset_encoder_cache",
    "/reset_mm_cache",
    "/reset_prefix_cache",
    "/resume",
    "/server_info",
    "/shutdown_weight_transfer_engine",
    "/sleep",
    "/start_draft_weight_update",
    "/start_weight_update",
    "/update_weight_version",
    "/update_weights",
    "/wake_up",
    "/weight_checker",
    "/weight_info",
)


_DEV_PATH_SET = frozenset(DEV_PATHS)
_DEV_PREFIXES = tuple(p + "/" for p in DEV_PATHS)


def is_dev_path(path: str) -> bool:
    """Asked for every request the guard sees: one set lookup and one ``startswith``."""
    return path in _DEV_PATH_SET or path.startswith(_DEV_PREFIXES)


@functools.cache
def _secret() -> bytes:
    from server.connector.pd.transfer_auth import load_cluster_secret

    return load_cluster_secret()


def from_router(proof: str | None, method: str, path: str, body: bytes) -> bool:
    """Whether ``proof`` (the :data:`ROUTER_PROOF_HEADER` value) is the router's for this
    request."""
    return proof is not None and verify(_secret(), proof, method, path, body)


def transfer_refusal(
    payload: dict[str, Any], proof: str | None, method: str, path: str, body: bytes
) -> tuple[str, str] | None:
    """(param, message) when a generating request carries transfer params the router did not
    sign, else None."""
    fields = transfer_fields(payload, path)
    if not fields:
        return None
    if fields == [TRANSFER_PARAMS_FIELD] and from_router(proof, method, path, body):
        return None
    return (
        fields[0],
        f"{fields[0]} is set by this cluster's P/D router only: send the request to the router "
        "(or remove the field)",
    )


def claim_refusal(proof: str | None, method: str, path: str, body: bytes) -> str | None:
    """The message when a hold claim or a revive is not signed by a member of the cluster (the
    router, or a replica), else None."""
    if path not in SIGNED_PATHS or from_router(proof, method, path, body):
        return None
    if path == REVIVE_PATH:
        return "revives are asked by this cluster's replicas only"
    return "hold claims are made by this cluster's P/D router only"
