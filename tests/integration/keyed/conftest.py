"""The package's keyed server: one engine start for the three modules instead of three,
launched at collection (:mod:`tests.prestart`): one keyed single server for the tenancy,
hostile-input and dialect modules, each with its own tenants
(:mod:`tests.integration.keyed.server`)."""

from __future__ import annotations

from tests import prestart
from tests.integration.keyed.server import keyed_server as keyed_server_process

keyed_server = prestart.fixture("keyed_server", lambda: (keyed_server_process(),), scope="package")
