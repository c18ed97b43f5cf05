"""The launcher's settings: its flags (``build_parser``), the connector classes it configures,
which API keys are in force (:func:`api_keys`), and :class:`LaunchError`. The environment it
hands vLLM and the plugin (``ENV_*``) is :mod:`server.common.env`, which the processes it starts
read without importing the launcher.

Its own module so that :mod:`server.launcher.cli` and :mod:`server.router.launch` both import from
here instead of from each other. Standard library only.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import TypeVar

from server.common.priority_code import DEFAULT_PRIORITY_AGING_S
from server.connector.config import DEFAULT_SYNC_PULL_WAIT_S
from server.engine.idle import DEFAULT_IDLE_POLL_MS
from server.engine.spin import DEFAULT_SPIN_MS

PLUGIN_NAME = "kvbranch"
CONNECTOR_CLASS = "KVBranchConnector"
CONNECTOR_MODULE = "server.connector.connector"
PD_CONNECTOR_CLASS = "KVBranchPDConnector"
NIXL_CONNECTOR_CLASS = "VerifiedNixlConnector"
PD_CONNECTOR_MODULE = "server.connector.pd"
#: The instance's outermost ASGI layer, given to vLLM's ``--middleware`` (applied after vLLM's
#: own middleware, so before its key check): server/plugin/header_gate.py.
HEADER_GATE = "server.plugin.header_gate.HeaderGate"
ROLES = ("single", "prefill", "decode", "router")
#: The roles of a P/D pair's instances (``--disagg`` and ``--cluster`` start them with ``--role``).
PD_ROLES = ("prefill", "decode")
GIB = 1 << 30


N = TypeVar("N", int, float)


class LaunchError(RuntimeError):
    """A launch problem the user can fix; printed as one line, exit status 2."""


def _value(
    convert: Callable[[str], N], noun: str, *rules: tuple[Callable[[N], bool], str]
) -> Callable[[str], N]:
    """An argparse type: ``convert`` the text (else "is not ``noun``"), then each rule in
    turn (else the rule's message)."""

    def parse(text: str) -> N:
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {noun}") from None
        for holds, message in rules:
            if not holds(value):
                raise argparse.ArgumentTypeError(f"{text!r} {message}")
        return value

    return parse


_POSITIVE = (lambda v: v > 0, "must be greater than 0")
_positive_float = _value(float, "a number", _POSITIVE)
_non_negative_float = _value(float, "a number", (lambda v: not v < 0, "must not be negative"))
#: Greater than 0 and finite: nan fails ``> 0`` too, and ``inf`` would be a deadline that never
#: fires (``call_later`` accepts it).
_seconds_up_to_a_minute = _value(
    float, "a number of seconds", (lambda v: 0 <= v <= 60, "must be between 0 and 60")
)
_finite_positive_float = _value(
    float, "a number", (lambda v: 0 < v < float("inf"), "must be a finite number greater than 0")
)
_port = _value(int, "a port number", (lambda v: 0 < v < 65536, "is not in 1-65535"))
_positive_int = _value(int, "an integer", _POSITIVE)
_microseconds = _value(
    int, "an integer", (lambda v: 0 <= v <= 1_000_000, "is not in 0-1000000 (microseconds)")
)
_share = _value(float, "a number", _POSITIVE, (lambda v: v <= 1, "must be at most 1"))
_index_url = _value(
    str,
    "an index URL",
    (
        lambda v: v == "memory" or v.startswith(("redis://", "rediss://", "unix://")),
        "is not 'memory', redis://host:port/db, rediss://... or unix:///path",
    ),
)
_block_size = _value(
    int, "an integer", (lambda v: v > 0 and not v & (v - 1), "must be a power of two")
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m server",
        description="kvbranch: vLLM's OpenAI-compatible server with a bidirectional KV "
        "connector (host-memory block store, pinned/forked/prefetched agent branches) and "
        "the /v1/kvbranch session routes.",
        epilog="Any other vLLM argument: put it after a literal '--', e.g. "
        "'python -m server -- --max-num-seqs 8'. It is passed to vLLM unchanged.",
    )
    parser.add_argument(
        "--model",
        default=None,
        help="model folder or name (default: the embedded SmolLM2-135M-"
        "Instruct, converted on first use; see KVBRANCH_MODEL_DIR)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default %(default)s)")
    parser.add_argument("--port", type=_port, default=8000, help="port (default %(default)s)")
    parser.add_argument(
        "--kv-cache-gib",
        type=_positive_float,
        default=1.0,
        help="device KV cache size in GiB, fractions allowed "
        "(default %(default)s; 1 GiB is about 23k tokens of the embedded model)",
    )
    parser.add_argument(
        "--block-size",
        type=_block_size,
        default=None,
        help="KV block size in tokens (default: the attention backend's; 128 on CPU)",
    )
    parser.add_argument(
        "--host-store-gib",
        type=_non_negative_float,
        default=2.0,
        help="host-memory KV block store size in GiB (default %(default)s; resident from "
        "start-up: pinned on CUDA, pre-faulted on CPU unless KVBRANCH_PREFAULT=0)",
    )
    parser.add_argument(
        "--pin-budget-gib",
        type=_non_negative_float,
        default=None,
        help="part of the host store that pins may hold (default: half)",
    )
    parser.add_argument(
        "--pin-ttl-s",
        type=_positive_float,
        default=300.0,
        help="default pin lease of a session's branches, renewed on each use (default %(default)s)",
    )
    parser.add_argument(
        "--max-model-len", type=int, default=8192, help="context length (default %(default)s)"
    )
    parser.add_argument(
        "--api-key",
        action="append",
        default=None,
        help="require this bearer key (repeat for several keys)",
    )
    parser.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error", "critical"],
        help="log level (default %(default)s)",
    )
    parser.add_argument(
        "--mq-spin-ms",
        type=_non_negative_float,
        default=DEFAULT_SPIN_MS,
        help="how long vLLM's engine core and worker busy-wait for each other's next message "
        "before sleeping on a socket; vLLM's own is 1000, which keeps a core spinning while "
        "the other computes (on small CPU hosts the API server, the router and a second "
        "instance need it) (default %(default)s)",
    )
    parser.add_argument(
        "--idle-poll-ms",
        type=_non_negative_float,
        default=DEFAULT_IDLE_POLL_MS,
        help="how long an engine with nothing to compute but KV blocks held for a P/D peer "
        "waits for new work before its next empty step; vLLM's own is 1 ms, a busy loop for "
        "as long as it holds them. New requests end the wait at once; 0 keeps vLLM's "
        "(default %(default)s)",
    )
    parser.add_argument(
        "--no-connector",
        action="store_true",
        help="plain vLLM without the kvbranch connector (the baseline used by "
        "tests and benchmarks); the kvbranch routes report it as not loaded",
    )
    parser.add_argument(
        "--served-model-name",
        default=None,
        help="model name clients send (default: the model folder's name)",
    )
    parser.add_argument(
        "--shutdown-grace-s",
        type=_non_negative_float,
        default=5.0,
        help="on SIGTERM, in-flight requests get this long before everything "
        "stops (the router and --disagg; an instance whose launcher died); "
        "vLLM itself aborts in-flight requests at once (default %(default)s)",
    )
    add_scheduling_args(parser)
    tenants = parser.add_argument_group(
        "tenants",
        "With API keys (--api-key, keys after '--', or VLLM_API_KEY) every key is a tenant with "
        "its own session ids, cache salt and quotas. See docs/security.md.",
    )
    tenants.add_argument(
        "--max-sessions-per-tenant",
        type=_positive_int,
        default=1000,
        help="sessions one key (or, without keys, the server) may hold; "
        "creating more gets 429 (default %(default)s)",
    )
    tenants.add_argument(
        "--max-branches-per-session",
        type=_positive_int,
        default=256,
        help="branches one session may hold; more get 409 (default %(default)s)",
    )
    tenants.add_argument(
        "--tenant-pin-share",
        type=_share,
        default=None,
        metavar="FRACTION",
        help="part of the pin budget one key's pins may hold, in (0, 1]; "
        "beyond it the key's own oldest pins degrade (default: 0.5 with two "
        "or more keys, else 1)",
    )
    tenants.add_argument(
        "--session-idle-ttl-s",
        type=_positive_float,
        default=6 * 3600.0,
        help="a session unused this long is deleted with its pins (default %(default)s = 6 h)",
    )
    pd = parser.add_argument_group(
        "prefill/decode disaggregation",
        "P and D are vLLM instances whose KV moves over NIXL (UCX); D keeps each session's "
        "KV after a turn and P pulls it back on the next one. The router sends each turn's "
        "prefill to P and decode to D. P and D act only on transfer handles sealed with the "
        "cluster secret: set KVBRANCH_CLUSTER_SECRET to the same value on every instance "
        "(--disagg makes one; instances on one machine otherwise share a private per-user "
        "file). See docs/pd.md.",
    )
    pd.add_argument(
        "--disagg",
        action="store_true",
        help="start a prefill instance, a decode instance (each on its own CPU "
        "cores) and the router on --port: a one-machine P/D cluster",
    )
    pd.add_argument(
        "--role", choices=ROLES, default="single", help="what this process is (default %(default)s)"
    )
    pd.add_argument(
        "--prefill",
        action="append",
        default=None,
        metavar="URL",
        help="router: a prefill instance's URL (repeat for several)",
    )
    pd.add_argument(
        "--decode",
        action="append",
        default=None,
        metavar="URL",
        help="router: a decode instance's URL (repeat for several)",
    )
    pd.add_argument(
        "--replica",
        action="append",
        default=None,
        metavar="URL",
        help="router: an aggregated replica's URL (an instance started with --role single "
        "--index URL; repeat for several): the router sends each turn to one replica, the "
        "one holding the session where it can (docs/cluster.md)",
    )
    pd.add_argument(
        "--router-policy",
        choices=("cache-aware", "always-split", "round-robin"),
        default="cache-aware",
        help="router: cache-aware (holds, pulls, P by prefill left and load; the D holding a "
        "branch serves its next turn alone unless it computes more prompts than P has requests; "
        "the default), "
        "always-split (cache-aware, every turn through P then D) or round-robin (no index at "
        "all: the baseline benchmarks/history/cluster_agents.py measured)",
    )
    pd.add_argument(
        "--router-tenant-inflight",
        type=int,
        default=None,
        metavar="N",
        help="router: requests in flight per API key (tenant) before 429 with Retry-After "
        "(default 128; without keys every client shares one count per Authorization header)",
    )
    pd.add_argument(
        "--header-timeout-s",
        type=_finite_positive_float,
        default=None,
        metavar="SECONDS",
        help="router: a client connection whose request headers are not complete this long "
        "after it opened or after its previous response ended is closed (slowloris "
        "protection) (default 30)",
    )
    pd.add_argument(
        "--nixl-port",
        type=_port,
        default=None,
        help="prefill/decode: NIXL side-channel port (default: --port + 10000)",
    )
    pd.add_argument(
        "--cpu-cores",
        default=None,
        metavar="LIST",
        help="CPU platform: cores this instance computes on, e.g. '0' or '2-3' "
        "(vLLM's VLLM_CPU_OMP_THREADS_BIND; default: vLLM's own choice); one list is spread "
        "over data-parallel engines",
    )
    pd.add_argument(
        "--pd-hold-ttl-s",
        type=_positive_float,
        default=30.0,
        help="how long D holds a finished turn's KV for P to pull (the engine "
        "keeps stepping while it holds); the router stops offering it 5 s "
        "earlier; D releases its oldest unclaimed holds sooner when new work "
        "needs the blocks (default %(default)s)",
    )
    pd.add_argument(
        "--nixl-progress-us",
        type=_microseconds,
        default=1000,
        metavar="US",
        help="prefill/decode and aggregated replicas: NIXL's progress thread polls every US "
        "microseconds, so a peer's read is served while the engine computes (0: no thread; "
        "reads wait for the end of the engine's forward; a thread found spinning is lowered "
        "to nice 19; default %(default)s)",
    )
    pd.add_argument(
        "--nixl-threads",
        choices=["watched", "lowered"],
        default="watched",
        help="NIXL's own threads (its progress thread, UCX's async thread): 'watched' keep the "
        "forward's priority and one found spinning (runnable 2 s on end) is lowered to nice 19; "
        "'lowered' run at nice 19 from the start, so a busy instance serves a peer's read only "
        "in CPU its forward leaves (default %(default)s; docs/cluster.md, 'A spinning NIXL "
        "progress thread')",
    )
    pd.add_argument(
        "--sync-pull-wait-s",
        type=_seconds_up_to_a_minute,
        default=DEFAULT_SYNC_PULL_WAIT_S,
        metavar="S",
        help="prefill and aggregated replicas: a pull from a peer is loaded before the engine "
        "step's forward, which waits for the read at most S seconds (past it, or on a failed "
        "read, those tokens are recomputed) and computes the turn's own tokens in the same "
        "step; 0: vLLM's asynchronous load (the turn waits two steps of other requests) "
        "(default %(default)s; docs/cluster.md, 'A pull the forward waits for')",
    )
    pd.add_argument(
        "--no-bidirectional",
        action="store_true",
        help="P/D without the D->P pull (the baseline: P recomputes what its own caches lack)",
    )
    cluster = parser.add_argument_group(
        "cluster index",
        "Instances and routers sharing one index (docs/cluster.md, docs/kv_events.md): each "
        "instance heartbeats its record and publishes which KV blocks it holds (vLLM's own "
        "KV events: device cache and host store); routers read it. Give every instance the "
        "same PYTHONHASHSEED (or none) so that block hashes agree.",
    )
    cluster.add_argument(
        "--index",
        type=_index_url,
        default="memory",
        metavar="URL",
        help="the cluster index: 'memory' (in the router's process; instances publish "
        "nothing), redis://host:port/db, rediss://... or unix:///path/to/redis.sock "
        "(default %(default)s)",
    )
    cluster.add_argument(
        "--cluster-name",
        default="default",
        metavar="NAME",
        help="namespace in the index: several clusters can share one Redis (default %(default)s)",
    )
    cluster.add_argument(
        "--allow-remote-kv-events",
        action="store_true",
        help="instance: accept a --kv-events-config (after '--') whose sockets reach beyond "
        "this machine (tcp://* or any non-loopback address; vLLM's own default is "
        "tcp://*:5557). Without it the launcher refuses one: KV events carry every tenant's "
        "token ids and vLLM's socket has no authentication (docs/kv_events.md)",
    )
    cluster.add_argument(
        "--no-peer-pull",
        action="store_true",
        help="instance (--role single with a shared --index): take no part in peer pulls — "
        "neither pull a session's KV from the replica that holds it nor hold this one's turns "
        "for the others (then every replica recomputes what it has not seen itself; "
        "docs/cluster.md, aggregated replicas)",
    )
    cluster.add_argument(
        "--advertise-url",
        default=None,
        metavar="URL",
        help="instance: the URL routers reach it at, as published in the index "
        "(default: http://<host>:<port>, 0.0.0.0 and :: as 127.0.0.1)",
    )
    one = parser.add_argument_group(
        "one-machine cluster",
        "--cluster starts a Redis for the index (unless --index is given), prefill and decode "
        "instances on their own CPU cores, and routers on --port, --port+1, ...; the flags "
        "that describe an instance (--model, --kv-cache-gib, ..., and what follows '--') go "
        "to every instance. Across machines start each role with --role and the same --index "
        "instead (docs/cluster.md).",
    )
    one.add_argument(
        "--cluster",
        action="store_true",
        help="start a whole cluster on this machine: Redis, --prefills P, --decodes D and "
        "--routers routers sharing one index and one cluster secret; SIGTERM or ^C stops it "
        "(routers first, then instances, then Redis)",
    )
    one.add_argument(
        "--prefills",
        type=_positive_int,
        default=1,
        metavar="N",
        help="--cluster: prefill instances (default %(default)s)",
    )
    one.add_argument(
        "--decodes",
        type=_positive_int,
        default=1,
        metavar="N",
        help="--cluster: decode instances (default %(default)s)",
    )
    one.add_argument(
        "--replicas",
        type=_positive_int,
        default=None,
        metavar="N",
        help="--cluster: N aggregated replicas (each prefills and decodes; a turn pulls its "
        "history from the replica that holds it) instead of --prefills/--decodes",
    )
    one.add_argument(
        "--routers",
        type=_positive_int,
        default=2,
        metavar="N",
        help="--cluster: routers, on --port, --port+1, ... (default %(default)s)",
    )
    return parser


#: ``--cold-prefill-chunk`` when not given: vLLM's --long-prefill-token-threshold, where the
#: warm-first scheduler applies it only while warmer work waits (``--agent-priority`` on CPU);
#: elsewhere no cap (vLLM's static threshold would make cold prefills share every step).
DEFAULT_COLD_PREFILL_CHUNK = 256
#: ``--agent-priority`` default: ``None`` is on where vLLM runs the warm-first scheduler (CPU,
#: measured there: docs/scheduling.md) and off elsewhere (vLLM's asynchronous CUDA scheduler
#: gets the priority without preemption or the by-need chunk: not measured), for the
#: plain-vLLM baseline (``--no-connector``) and on P/D instances (``--role prefill|decode``:
#: measured no better there, docs/scheduling.md "On P/D").
DEFAULT_AGENT_PRIORITY: bool | None = None


def add_scheduling_args(parser: argparse.ArgumentParser) -> None:
    """Agent-aware scheduling (docs/scheduling.md): vLLM's own levers, set from what kvbranch
    knows about a request."""
    group = parser.add_argument_group(
        "scheduling",
        "A resumed agent turn (most of its prompt cached) ahead of cold prefills, and a cold "
        "prefill that cannot hold a whole engine step. Flags of vLLM's own after '--' "
        "(--scheduling-policy, --long-prefill-token-threshold) win over these. "
        "See docs/scheduling.md.",
    )
    group.add_argument(
        "--agent-priority",
        action=argparse.BooleanOptionalAction,
        default=DEFAULT_AGENT_PRIORITY,
        help="start vLLM with --scheduling-policy priority and give each request a priority "
        "from how much of its prompt the tenant sent before (resumed turns and forks first), "
        "with aging (a warmer request passes a colder one only within a bounded window), and "
        "on CPU preempt a colder running prefill that holds the device blocks a warmer "
        "request needs; a client's own 'priority' can only make its request later "
        "(default: on with the CPU backend, off on CUDA, with --no-connector and on P/D "
        "instances: --disagg, --cluster, --role prefill|decode)",
    )
    group.add_argument(
        "--priority-aging-s",
        type=_positive_float,
        default=DEFAULT_PRIORITY_AGING_S,
        help="--agent-priority: seconds of arrival time one level of priority is worth; a "
        "request is never passed by one arriving more than 3x this after it "
        "(default %(default)s)",
    )
    group.add_argument(
        "--cold-prefill-chunk",
        type=_value(int, "an integer", (lambda v: v >= 0, "must not be negative")),
        default=None,
        metavar="TOKENS",
        help="at most this many prompt tokens of one request per engine step while other "
        "requests are running or waiting (vLLM's --long-prefill-token-threshold; a request "
        f"alone is not capped); 0: no cap (default: {DEFAULT_COLD_PREFILL_CHUNK} with "
        "--agent-priority on CPU, where only warmer waiting work applies it; else 0)",
    )


def advertise_url(args: argparse.Namespace) -> str:
    """``--advertise-url``, else ``http://<host>:<port>`` with a wildcard host as loopback."""
    if getattr(args, "advertise_url", None):
        return str(args.advertise_url).rstrip("/")
    host = "127.0.0.1" if args.host in ("0.0.0.0", "::", "") else args.host
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{args.port}"


def index_enabled(args: argparse.Namespace) -> bool:
    """An index other than the embedded one: instances publish into it."""
    return (getattr(args, "index", None) or "memory") != "memory"


def peer_replica(args: argparse.Namespace) -> bool:
    """An aggregated replica that pulls from its peers and holds its turns for them: a single
    instance with the connector and a shared index, unless ``--no-peer-pull``."""
    return (
        getattr(args, "role", "single") == "single"
        and index_enabled(args)
        and not getattr(args, "no_connector", False)
        and not getattr(args, "no_peer_pull", False)
    )


def passthrough_api_keys(passthrough: list[str]) -> list[str] | None:
    """The keys an ``--api-key`` after ``--`` gives vLLM (its flag takes a list and the last
    one wins; vLLM also spells it ``--api_key``), or ``None`` when there is none."""
    keys: list[str] | None = None
    i = 0
    while i < len(passthrough):
        name, eq, value = passthrough[i].partition("=")
        i += 1
        if name not in ("--api-key", "--api_key"):
            continue
        if eq:
            keys = [value]
            continue
        keys = []
        while i < len(passthrough) and not passthrough[i].startswith("-"):
            keys.append(passthrough[i])
            i += 1
    return keys


def api_keys(args: argparse.Namespace, passthrough: list[str]) -> list[str]:
    """The keys vLLM will enforce (its rule: ``--api-key`` wins over ``VLLM_API_KEY``).
    Refuses the setups where vLLM would silently drop keys the user gave."""
    ours = args.api_key or []
    theirs = passthrough_api_keys(passthrough)
    env_key = os.environ.get("VLLM_API_KEY")
    if ours and theirs is not None:
        raise LaunchError(
            "API keys given both before and after '--' (vLLM would keep only "
            "the ones after it): give them once, e.g. repeat --api-key before "
            "'--'"
        )
    given = ours or theirs
    if given and env_key:
        raise LaunchError(
            "VLLM_API_KEY is set and --api-key is given (vLLM would ignore "
            "VLLM_API_KEY): unset VLLM_API_KEY or drop --api-key"
        )
    return [k for k in (given or [env_key]) if k]
