"""Fixtures shared by the integration modules: the keyed P/D cluster (one per test session;
see :mod:`tests.integration.trust_cluster`)."""

from __future__ import annotations

import pytest

from server.connector.pd.transfer_auth import ENV_CLUSTER_SECRET
from tests.integration.trust_cluster import CLUSTER_SECRET, KEYS, trust_instance
from tests.server_process import ServerProcess


@pytest.fixture(scope="session")
def keyed_pd():
    """(prefill, decode, router); each one's ``headers()`` carry tenant A's key."""
    prefill, decode = trust_instance("prefill", "0"), trust_instance("decode", "1")
    router = None
    try:
        prefill.launch()
        decode.launch()
        prefill.wait_ready()
        decode.wait_ready()
        router = ServerProcess(
            [
                "--role",
                "router",
                "--prefill",
                prefill.url,
                "--decode",
                decode.url,
                "--pd-hold-ttl-s",
                "900",
                *KEYS,
            ],
            name="trust-router",
            ready_timeout=120,
            env={ENV_CLUSTER_SECRET: CLUSTER_SECRET},
        ).start()
        yield prefill, decode, router
    finally:
        for proc in (router, prefill, decode):
            if proc is not None:
                proc.stop()
