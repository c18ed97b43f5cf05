"""The keyed single server of this package (started once, stopped after its last module): the
tenancy, hostile-input and dialect modules used to start one each (three engine starts, 35-60 s
apiece on CI's 2 cores).

Each module keeps its own tenants (its own keys below), and quotas are per tenant, so one
module's sessions never count against another's. The flags are the union of what the three
needed: the quotas of test_tenancy and test_hostile_input (the same 20 sessions per tenant,
4 branches per session), ``--enable-scale-out`` (vLLM serves /inference/v1/generate only with
it), and vLLM's response store (``store`` is ignored without it).

The keys are given after ``--``, as a user hands them to vLLM unchanged (``--api-key K1 K2 ...``):
that the launcher still makes one tenant per key is what test_passthrough_keys checks, on this
server instead of one of its own (the launcher's own ``--api-key`` reaches vLLM the same way, and
the keyed P/D pair uses it). The other way in, ``VLLM_API_KEY``, has its own server in
tests/integration/test_tenant_keys.py.
"""

from __future__ import annotations

from tests.integration.helpers import size_args
from tests.server_process import ServerProcess

TENANCY_KEYS = ("tenant-a-key", "tenant-b-key", "tenant-c-key")
HOSTILE_KEYS = ("hostile-a-key", "hostile-b-key")
DIALECT_KEYS = ("dialect-tenant-a", "dialect-tenant-b")
PASSTHROUGH_KEYS = ("pass-a-key", "pass-b-key")
UI_KEYS = ("ui-a-key", "ui-b-key")  # test_ui: the agent page
MAX_SESSIONS, MAX_BRANCHES = 20, 4


def keyed_server() -> ServerProcess:
    args = [
        *size_args(0.25, 0.1, 2048),
        "--max-sessions-per-tenant",
        str(MAX_SESSIONS),
        "--max-branches-per-session",
        str(MAX_BRANCHES),
        "--",
        "--enable-scale-out",
        "--api-key",
        *TENANCY_KEYS,
        *HOSTILE_KEYS,
        *DIALECT_KEYS,
        *PASSTHROUGH_KEYS,
        *UI_KEYS,
    ]
    return ServerProcess(
        args,
        name="keyed",
        ready_timeout=1500,
        env={"VLLM_ENABLE_RESPONSES_API_STORE": "1"},
    )
