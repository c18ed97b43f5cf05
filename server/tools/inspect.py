"""``python -m server.inspect``: what a running kvbranch server (or P/D router) holds, from the
command line — for an operator, and with ``--json`` for scripts.

    python -m server.inspect health                  # the server, or the router and its instances
    python -m server.inspect sessions                # your sessions (the key's), most recent first
    python -m server.inspect session SESSION_ID      # its branches: where their KV is, pins, leases
    python -m server.inspect cluster                 # router only: instances and the cluster index
    python -m server.inspect stats                   # host store and hit counters

It talks HTTP to the public routes only (``/v1/kvbranch/...``), with the same key a client
would use (``--api-key`` or ``KVBRANCH_API_KEY``): what it shows is what that key may see. It
looks at the server the sdk talks to (``--url``, else ``KVBRANCH_BASE_URL``, as the sdk reads
it; the inspector's former ``KVBRANCH_URL`` still works, with a warning). Every
answer is parsed with the wire contract's models (:mod:`sdk.contract`), so a server that speaks
another contract is a clear error, not a wrong table.

Where a branch's KV is: ``host`` blocks are in the instance's host store; ``held on`` names the
decode instance that holds the conversation for the next turn's pull (through a router); the
device prefix cache is vLLM's own and is not reported per branch.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

import httpx
from pydantic import BaseModel, ValidationError

from sdk.contract import (
    HEALTH_PATH,
    STATS_PATH,
    HealthInfo,
    RouterHealthInfo,
    RouterStats,
    SessionInfo,
    Stats,
    session_path,
)

#: The server's URL, the same variable the sdk, the integrations and the examples read.
ENV_URL = "KVBRANCH_BASE_URL"
#: The inspector's former name for it: still read when ``ENV_URL`` is unset, with a warning,
#: so that a script written for it keeps working while it moves to the one name.
DEPRECATED_ENV_URL = "KVBRANCH_URL"
ENV_API_KEY = "KVBRANCH_API_KEY"
DEFAULT_URL = "http://127.0.0.1:8000"

logger = logging.getLogger(__name__)
_warned_deprecated_url = False


def default_url() -> str:
    """``$KVBRANCH_BASE_URL``, else the deprecated ``$KVBRANCH_URL`` (warned about once per
    process), else ``http://127.0.0.1:8000``. A trailing ``/v1``, as the sdk accepts in the same
    variable, is dropped: the inspector's paths start with ``/v1``."""
    global _warned_deprecated_url
    url = os.environ.get(ENV_URL)
    if not url:
        url = os.environ.get(DEPRECATED_ENV_URL)
        if url and not _warned_deprecated_url:
            _warned_deprecated_url = True
            logger.warning("%s is deprecated: set %s instead", DEPRECATED_ENV_URL, ENV_URL)
    url = (url or DEFAULT_URL).strip().rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


class InspectError(Exception):
    """A one-line reason the command could not answer (exit status 2)."""


def fetch(client: httpx.Client, path: str) -> Any:
    try:
        r = client.get(path)
    except httpx.HTTPError as exc:
        raise InspectError(f"{client.base_url}{path}: {type(exc).__name__}: {exc}") from None
    if r.status_code != 200:
        try:
            message = r.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = r.text[:200]
        raise InspectError(f"{path}: HTTP {r.status_code}: {message}")
    try:
        return r.json()
    except ValueError:
        raise InspectError(f"{path}: the answer is not JSON") from None


def parse(model: type[BaseModel], data: Any, what: str) -> Any:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise InspectError(f"{what} does not match this kvbranch's contract: {exc}") from None


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows, strict=True)]
    lines = [header, ["-" * w for w in widths], *rows]
    return "\n".join(
        "  ".join(str(c).ljust(w) for c, w in zip(line, widths, strict=True)).rstrip()
        for line in lines
    )


def _ttl(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds:.0f}s" if seconds < 120 else f"{seconds / 60:.0f}m"


# --- the commands: each returns (data for --json, text) ------------------------------------
def health(client: httpx.Client) -> tuple[Any, str]:
    data = fetch(client, HEALTH_PATH)
    if data.get("role") == "router":
        info = parse(RouterHealthInfo, data, "health")
        rows = [
            [i.role, i.url, "up" if i.alive else "DOWN", str(i.inflight), str(i.failures)]
            for i in info.instances
        ]
        text = f"router: {info.status}, model {info.model or '?'}\n" + _table(
            rows, ["role", "url", "state", "inflight", "failures"]
        )
        return info.model_dump(), text
    single = parse(HealthInfo, data, "health")
    c = single.connector
    text = (
        f"{single.role or 'single'}: {single.status}, model {single.model}, kvbranch "
        f"{single.kvbranch_version}, vLLM {single.vllm_version}\n"
        f"connector {c.name} {'loaded' if c.loaded else 'NOT loaded'}, block size "
        f"{c.block_size}, host store {c.store_capacity_bytes or 0} B, pin budget "
        f"{c.pin_budget_bytes or 0} B"
    )
    return single.model_dump(), text


def _stats(client: httpx.Client) -> Stats:
    data = fetch(client, STATS_PATH)
    model: type[BaseModel] = RouterStats if "cluster" in data else Stats
    stats: Stats = parse(model, data, "stats")
    return stats


def sessions(client: httpx.Client) -> tuple[Any, str]:
    stats = _stats(client)
    rows = [
        [
            s.session_id,
            str(len(s.branches)),
            str(sum(b.num_tokens for b in s.branches)),
            str(s.pinned_blocks),
            "auto" if s.auto_pin else "-",
        ]
        for s in stats.sessions
    ]
    data = [s.model_dump() for s in stats.sessions]
    shown = f"{len(rows)} of {stats.num_own_sessions or len(rows)} session(s)"
    return data, shown + "\n" + _table(rows, ["session", "branches", "tokens", "pinned", "pin"])


def session(client: httpx.Client, session_id: str) -> tuple[Any, str]:
    info: SessionInfo = parse(SessionInfo, fetch(client, session_path(session_id)), "session")
    held: dict[str, Any] = {}
    data = fetch(client, STATS_PATH)
    if "cluster" in data:
        cluster = parse(RouterStats, data, "stats").cluster
        held = {e.branch_id: e for e in cluster.index if e.session_id == session_id}
    rows = []
    for b in info.branches:
        entry = held.get(b.branch_id)
        pin = "-"
        if b.pinned:
            pin = f"pinned {_ttl(b.pin_expires_in_s)}" + (" (degraded)" if b.degraded else "")
        rows.append(
            [
                b.branch_id,
                b.parent or "-",
                str(b.num_tokens),
                str(b.stored_blocks),
                pin,
                f"{entry.decode} ({entry.tokens} tok, {_ttl(entry.expires_in_s)})"
                if entry
                else "-",
                str(b.requests),
            ]
        )
    text = (
        f"session {info.session_id}: {len(info.branches)} branch(es), auto-pin "
        f"{'on' if info.auto_pin else 'off'} ({_ttl(info.pin_ttl_s)}), "
        f"{info.pinned_blocks} pinned block(s)\n"
        + _table(rows, ["branch", "parent", "tokens", "host", "pin", "held on", "requests"])
    )
    out = info.model_dump()
    out["held_on"] = {k: v.model_dump() for k, v in held.items()}
    return out, text


def cluster(client: httpx.Client) -> tuple[Any, str]:
    data = fetch(client, STATS_PATH)
    if "cluster" not in data:
        raise InspectError("not a P/D router: its stats carry no cluster (use 'health')")
    info = parse(RouterStats, data, "stats").cluster
    instances = _table(
        [
            [i.role, i.url, "up" if i.alive else "DOWN", str(i.requests), str(i.failures)]
            for i in info.instances
        ],
        ["role", "url", "state", "requests", "failures"],
    )
    index = _table(
        [
            [e.session_id, e.branch_id, e.decode, str(e.tokens), _ttl(e.expires_in_s)]
            for e in info.index
        ],
        ["session", "branch", "held on", "tokens", "expires"],
    )
    counters = ", ".join(f"{k} {v}" for k, v in sorted(info.index_counters.items()))
    text = (
        f"{instances}\n\nindex (hold TTL {_ttl(info.hold_ttl_s)}; {counters or 'no counters'}):"
        f"\n{index}"
    )
    return info.model_dump(), text


def stats(client: httpx.Client) -> tuple[Any, str]:
    s = _stats(client)
    store = s.store
    hits = ", ".join(f"{k} {v}" for k, v in sorted(s.hits_tokens.items()))
    text = (
        f"host store: {store.used_blocks}/{store.capacity_blocks} blocks "
        f"({store.used_bytes} B), pinned {store.pinned_blocks} ({store.pinned_bytes} of "
        f"{store.pin_budget_bytes} B), evictions {store.evictions}, store resets "
        f"{s.store_resets}\nprompt tokens by source: {hits}\nrequests {s.requests}, prefetches "
        f"{s.prefetches} (+{s.prefetches_skipped} skipped), pins degraded {s.pins_degraded}, "
        f"refused {s.pins_refused}"
    )
    if s.pd is not None:
        declined = ", ".join(f"{k} {v}" for k, v in sorted(s.pd.handles_declined.items()))
        text += (
            f"\nP/D: {s.pd.holds} hold(s) ({s.pd.held_blocks} blocks), claims {s.pd.claims} "
            f"(refused {s.pd.claims_refused}), declined handles: {declined or 'none'}"
        )
    return s.model_dump(), text


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m server.inspect",
        description="Show what a running kvbranch server or P/D router holds: sessions, "
        "branches and where their KV is, pins and leases, the cluster's instances and index.",
    )
    parser.add_argument(
        "--url", default=None, help=f"server or router (default ${ENV_URL}, else {DEFAULT_URL})"
    )
    parser.add_argument(
        "--api-key",
        default=os.environ.get(ENV_API_KEY),
        help=f"the key to look with: you see what it may see ({ENV_API_KEY})",
    )
    parser.add_argument("--json", action="store_true", help="print JSON (for scripts)")
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds per request")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("health", help="the server, or the router and its instances")
    sub.add_parser("sessions", help="the key's sessions, most recently used first")
    one = sub.add_parser("session", help="one session's branches, pins and where their KV is")
    one.add_argument("session_id")
    sub.add_parser("cluster", help="P/D router: instances and the cluster index")
    sub.add_parser("stats", help="host store and hit counters")
    return parser


def main(
    argv: Sequence[str] | None = None, out: Any = None, transport: httpx.BaseTransport | None = None
) -> int:
    args = build_parser().parse_args(argv)
    out = out or sys.stdout
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    url = args.url or default_url()
    with httpx.Client(
        base_url=url, headers=headers, timeout=args.timeout, transport=transport
    ) as client:
        try:
            if args.command == "session":
                data, text = session(client, args.session_id)
            else:
                data, text = COMMANDS[args.command](client)
        except InspectError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    print(json.dumps(data, indent=2) if args.json else text, file=out)
    return 0


COMMANDS = {"health": health, "sessions": sessions, "cluster": cluster, "stats": stats}

if __name__ == "__main__":
    sys.exit(main())
