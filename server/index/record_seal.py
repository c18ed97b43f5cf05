"""Instance records a router can trust: each is sealed by its instance under the cluster secret.

A router sends an instance clients' prompts, their API keys (the instances check them too) and
requests signed with the cluster secret. With a shared index, which instances exist is read from
the index (the heartbeats, :mod:`server.index.publisher`), and whoever can write to the index's
Redis could otherwise add a record naming a URL of their choosing: the router's probe asks only
for a 200 and JSON, so every turn routed there would hand that URL a tenant's conversation.

So every record carries :attr:`~server.index.membership.InstanceRecord.mac`: the HMAC of
:mod:`server.common.cluster_auth` (``"<unix ms>.<hex HMAC-SHA256>"``) over every field of the
record — identity, URL, role, model, block size, NIXL side channel, generation, load — keyed
with a key derived from the cluster secret for this one use (so a record's MAC is never a router
proof, nor the other way round). Instances seal at every heartbeat; a router lists a record only
when its MAC verifies and is at most :data:`~server.common.cluster_auth.MAX_SKEW_S` old. A Redis
writer without the secret can delete records or replay a real instance's recent one (its own
URL: an instance that is gone fails its probe), so at most turns recompute; it cannot point a
router anywhere.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from dataclasses import replace

from server.common import cluster_auth
from server.index.membership import InstanceRecord

#: Derives the record key from the cluster secret (domain separation from the router's proofs).
_LABEL = b"kvbranch index instance record v1"
#: The "method" and "path" the proof format wants: labels only (no HTTP path starts so).
_METHOD = "RECORD"
_PATH = "kvbranch-index-instance-record"


def _key(secret: bytes) -> bytes:
    return hmac.new(secret, _LABEL, hashlib.sha256).digest()


def _body(record: InstanceRecord) -> bytes:
    """Every field but the MAC, in a form that survives the Redis backend's strings (ints as
    ints, floats as floats: ``repr`` round trips them exactly)."""
    return json.dumps(
        [
            record.instance_id,
            record.url,
            record.role,
            record.model,
            int(record.block_size),
            record.nixl,
            int(record.generation),
            int(record.host_generation),
            int(record.load),
            float(record.kv_usage),
            int(record.engines),
            float(record.started_at),
        ],
        separators=(",", ":"),
    ).encode()


def seal(record: InstanceRecord, secret: bytes, now: float | None = None) -> InstanceRecord:
    """``record`` with its MAC (stamped ``now``, wall clock by default)."""
    mac = cluster_auth.sign(_key(secret), _METHOD, _PATH, _body(record), now)
    return replace(record, mac=mac)


def verify(record: InstanceRecord, secret: bytes, now: float | None = None) -> bool:
    """Whether an instance with ``secret`` sealed exactly this record, recently. Never raises:
    anything a hostile store can put in a record (wrong types, huge text) is just False."""
    try:
        return cluster_auth.verify(_key(secret), record.mac, _METHOD, _PATH, _body(record), now)
    except (TypeError, ValueError, OverflowError):
        return False
