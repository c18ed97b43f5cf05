"""The keyed P/D cluster, one per test session: real P, D and router (NIXL over UCX on
loopback) with two API keys (two tenants) and a cluster secret the tests know — so a test can
play a client of either tenant, or sign requests as the router does (``RouterProof``).

Sized to run beside the plain reference server: a small device cache (0.1 GiB, 18 blocks of
128 tokens) and long holds (900 s), so that holds, claims and releases are all reachable."""

from __future__ import annotations

import secrets

from server.connector.pd.transfer_auth import ENV_CLUSTER_SECRET
from tests.integration.helpers import RouterProof, pd_instance
from tests.server_process import ServerProcess

CLUSTER_SECRET = secrets.token_hex(32)
KEY_A = "tenant-a-" + secrets.token_hex(8)
KEY_B = "tenant-b-" + secrets.token_hex(8)
KEYS = ["--api-key", KEY_A, "--api-key", KEY_B]
#: The routers' ``--header-timeout-s``: a client whose request headers are not complete this long
#: after it connected is cut off. Short, so a test of it waits seconds, not the default 30 s.
ROUTER_HEADER_TIMEOUT_S = 5.0
TRUST_INSTANCE_ARGS = [
    "--kv-cache-gib",
    "0.1",
    "--host-store-gib",
    "0.25",
    "--max-model-len",
    "2048",
    "--pd-hold-ttl-s",
    "900",
    *KEYS,
]


def as_router() -> RouterProof:
    """Requests signed as this cluster's router signs them."""
    return RouterProof(CLUSTER_SECRET)


def trust_instance(role: str, core: str) -> ServerProcess:
    env = {ENV_CLUSTER_SECRET: CLUSTER_SECRET}
    return pd_instance(TRUST_INSTANCE_ARGS, role, core, name=f"trust-{role}", env=env)


def trust_router(
    prefill: ServerProcess, decode: ServerProcess, *extra: str, name: str = "trust-router"
) -> ServerProcess:
    """A router in front of ``prefill`` and ``decode`` with the two keys, the cluster secret and
    a header deadline of :data:`ROUTER_HEADER_TIMEOUT_S` (``extra``: more router flags, e.g.
    ``--index``); not started yet."""
    return ServerProcess(
        [
            "--role",
            "router",
            "--prefill",
            prefill.url,
            "--decode",
            decode.url,
            "--pd-hold-ttl-s",
            "900",
            # every turn through P: the tests check holds and pulls (docs/pd.md, decode-local)
            "--router-policy",
            "always-split",
            "--header-timeout-s",
            str(ROUTER_HEADER_TIMEOUT_S),
            *KEYS,
            *extra,
        ],
        name=name,
        ready_timeout=120,
        env={ENV_CLUSTER_SECRET: CLUSTER_SECRET},
    )
