"""Fixtures shared by the integration modules: the keyed P/D cluster (one per test session;
see :mod:`tests.integration.trust_cluster`), its instances launched at collection
(:mod:`tests.prestart`)."""

from __future__ import annotations

import pytest

from tests import prestart
from tests.integration.trust_cluster import trust_instance, trust_router
from tests.server_process import ServerProcess


@prestart.shared("keyed_pd")
def _keyed_pd_instances() -> tuple[ServerProcess, ...]:
    return trust_instance("prefill", "0"), trust_instance("decode", "1")


@pytest.fixture(scope="session")
def keyed_pd():
    """(prefill, decode, router); each one's ``headers()`` carry tenant A's key."""
    with prestart.running(prestart.take("keyed_pd")) as (prefill, decode):
        with trust_router(prefill, decode) as router:
            yield prefill, decode, router
