"""Fixtures shared by the integration modules: the keyed P/D cluster (one per test session;
see :mod:`tests.integration.trust_cluster`)."""

from __future__ import annotations

import pytest

from tests.integration.trust_cluster import trust_instance, trust_router


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
        router = trust_router(prefill, decode).start()
        yield prefill, decode, router
    finally:
        for proc in (router, prefill, decode):
            if proc is not None:
                proc.stop()
