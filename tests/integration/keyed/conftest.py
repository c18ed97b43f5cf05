"""The package's keyed server: one engine start for the three modules instead of three."""

from __future__ import annotations

import pytest

from tests.integration.keyed.server import keyed_server as start_keyed_server


@pytest.fixture(scope="package")
def keyed_server():
    """One keyed single server for the tenancy, hostile-input and dialect modules, each with its
    own tenants (:mod:`tests.integration.keyed.server`)."""
    with start_keyed_server() as server:
        yield server
