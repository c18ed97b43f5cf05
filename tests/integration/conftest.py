"""Fixtures shared by the integration modules: the keyed P/D cluster (one per test session;
see :mod:`tests.integration.trust_cluster`), its instances launched at collection
(:mod:`tests.prestart`); the aggregated replicas' cluster that test_replicas_edge,
test_replica_router and test_replicas share (:mod:`tests.integration.replica_fixture`),
launched ahead of the first of them."""

from __future__ import annotations

import pytest

from tests import prestart
from tests.integration.replica_fixture import ReplicaCluster
from tests.integration.trust_cluster import trust_instance, trust_router

keyed_pd_instances = prestart.fixture(
    "keyed_pd_instances",
    lambda: (trust_instance("prefill", "0"), trust_instance("decode", "1")),
    engines=2,
)


@pytest.fixture(scope="session")
def keyed_pd(keyed_pd_instances):
    """(prefill, decode, router); each one's ``headers()`` carry tenant A's key."""
    prefill, decode = keyed_pd_instances
    with trust_router(prefill, decode) as router, prestart.held("keyed_pd", (router,)):
        yield prefill, decode, router


replica_cluster = prestart.fixture(
    "replica_cluster", lambda: (ReplicaCluster(),), scope="session", engines=2, ahead=True
)


@pytest.fixture
def replicas(replica_cluster):
    """The aggregated replicas' cluster, whole: what a test before this one broke (a replica
    killed, Redis stopped) is mended first (:meth:`ReplicaCluster.whole`)."""
    replica_cluster.whole()
    return replica_cluster
