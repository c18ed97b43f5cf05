"""The package's keyed server: one engine start for the three modules instead of three,
launched at collection (:mod:`tests.prestart`)."""

from __future__ import annotations

import pytest

from tests import prestart
from tests.integration.keyed.server import keyed_server as keyed_server_process
from tests.server_process import ServerProcess


@prestart.shared("keyed_server")
def _keyed_server() -> tuple[ServerProcess, ...]:
    return (keyed_server_process(),)


@pytest.fixture(scope="package")
def keyed_server():
    """One keyed single server for the tenancy, hostile-input and dialect modules, each with its
    own tenants (:mod:`tests.integration.keyed.server`)."""
    with prestart.running(prestart.take("keyed_server")) as (server,):
        yield server
