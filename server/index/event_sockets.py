"""Where an instance's KV-event sockets may reach: this machine only, unless the operator says
otherwise.

vLLM's KV events carry every block's token ids and cache salt (every tenant's prompts, in
order) and vLLM's PUB socket has no authentication: whoever connects reads them all, and its
default endpoint is ``tcp://*:5557`` (every interface). The launcher's own configuration is
``ipc://`` in the instance's private directory (:func:`server.launcher.cli.kv_events_config`); this
module reads a ``--kv-events-config`` given after ``--`` the way vLLM would and names the
endpoints that would reach beyond the machine, so the launcher can refuse them without
``--allow-remote-kv-events`` (docs/kv_events.md says how to feed an external indexer privately).

Private: ``ipc://`` and ``inproc://``; ``tcp://`` to a loopback address (``127.0.0.0/8``,
``[::1]``, ``localhost``). Everything else is exposed: a wildcard or any other address, a host or
interface name (zmq binds to interfaces by name), other transports (``pgm``, ``udp``, ``ws``…).
A configuration given some other way (vLLM's ``--config`` file) is not read here.
"""

from __future__ import annotations

import ipaddress
import json
from typing import Any

FLAG = "--kv-events-config"
#: vLLM's KVEventsConfig.endpoint default: every interface.
VLLM_DEFAULT_ENDPOINT = "tcp://*:5557"
_SPELLINGS = (FLAG, "--" + FLAG[2:].replace("-", "_"))
_LOOPBACK_NAMES = ("localhost", "ip6-localhost")


def is_private(endpoint: str) -> bool:
    """Whether a zmq endpoint stays on this machine."""
    scheme, sep, rest = endpoint.partition("://")
    if not sep:
        return False
    if scheme in ("ipc", "inproc"):
        return True
    if scheme != "tcp":
        return False
    host = rest.rpartition(":")[0] if ":" in rest else rest
    host = host.rpartition(";")[2]  # "source;destination": the destination decides
    host = host.strip("[]").lower()
    if host in _LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _configs(passthrough: list[str]) -> list[dict[str, Any]]:
    """Each reading of the flags vLLM might take: the last JSON value, the dotted
    ``--kv-events-config.<field>`` values, and the two merged (vLLM appends the dotted ones as a
    JSON value of their own; reading all three is the conservative choice)."""
    whole: dict[str, Any] | None = None
    dotted: dict[str, Any] = {}
    i = 0
    while i < len(passthrough):
        arg = passthrough[i]
        name, eq, value = arg.partition("=")
        base, dot, field = name.partition(".")
        if base in _SPELLINGS:
            if not eq:
                value = passthrough[i + 1] if i + 1 < len(passthrough) else ""
                i += 1
            try:
                parsed: Any = json.loads(value)
            except ValueError:
                parsed = value
            if dot:
                dotted[field] = parsed
            elif isinstance(parsed, dict):
                whole = parsed
        i += 1
    out = [c for c in (whole, dotted or None) if c is not None]
    if whole is not None and dotted:
        out.append({**whole, **dotted})
    return out


def exposed_endpoints(passthrough: list[str]) -> list[str]:
    """The KV-event endpoints vLLM's flags after ``--`` would open beyond this machine
    (vLLM's default endpoint included when events are on and none is given); [] when events
    are off or every endpoint is private."""
    out: list[str] = []
    for config in _configs(passthrough):
        if not _truthy(config.get("enable_kv_cache_events")):
            continue
        if config.get("publisher", "zmq") not in ("zmq", None):
            continue
        endpoint = config.get("endpoint", VLLM_DEFAULT_ENDPOINT)
        for ep in (endpoint, config.get("replay_endpoint")):
            if ep is None:
                continue
            ep = str(ep)
            if not is_private(ep) and ep not in out:
                out.append(ep)
    return out


def _truthy(value: Any) -> bool:
    if isinstance(value, str):
        return value.strip().lower() in ("1", "true", "yes", "on")
    return bool(value)
