"""The keyed single server of this package (started once, stopped after its last module): the
tenancy, hostile-input and dialect modules used to start one each (three engine starts, 35-60 s
apiece on CI's 2 cores).

Each module keeps its own tenants (its own keys below), and quotas are per tenant, so one
module's sessions never count against another's. The flags are the union of what the three
needed: the quotas of test_tenancy and test_hostile_input (the same 20 sessions per tenant,
4 branches per session), ``--enable-scale-out`` (vLLM serves /inference/v1/generate only with
it), and vLLM's response store (``store`` is ignored without it).
"""

from __future__ import annotations

from tests.integration.helpers import keyed_server_args
from tests.server_process import ServerProcess

TENANCY_KEYS = ("tenant-a-key", "tenant-b-key", "tenant-c-key")
HOSTILE_KEYS = ("hostile-a-key", "hostile-b-key")
DIALECT_KEYS = ("dialect-tenant-a", "dialect-tenant-b")
MAX_SESSIONS, MAX_BRANCHES = 20, 4


def keyed_server() -> ServerProcess:
    args = [
        *keyed_server_args(*TENANCY_KEYS, *HOSTILE_KEYS, *DIALECT_KEYS),
        "--max-sessions-per-tenant",
        str(MAX_SESSIONS),
        "--max-branches-per-session",
        str(MAX_BRANCHES),
        "--",
        "--enable-scale-out",
    ]
    return ServerProcess(
        args,
        name="keyed",
        ready_timeout=1500,
        env={"VLLM_ENABLE_RESPONSES_API_STORE": "1"},
    )
