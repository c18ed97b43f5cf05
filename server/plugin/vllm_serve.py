"""vLLM started by its own CLI (``vllm serve``, ``python -m vllm.entrypoints.openai.api_server``):
the plugin's settings read from the kv-transfer-config instead of the launcher's environment.

Why: ``python -m server`` gives the connector its settings in ``kv_connector_extra_config`` and
the API server's plugin its own in the environment (:mod:`server.common.env`: the control
socket, the role, the cluster index). vLLM's CLI sets none of that environment, so the plugin
found no control socket: the session routes answered "connector not loaded" and turns kept no
session state. Here the plugin finds the kvbranch connector's entry in the kv-transfer-config
vLLM parsed (at the top, or a child of a composing connector such as ``KVBranchPDConnector`` or
vLLM's ``MultiConnector``) and fills in each variable the launcher did not set. Under the
launcher both say the same (it writes the same values into both), and its environment wins.

What cannot come from the config, because other processes read it before the plugin runs or
because it is a secret, stays in the environment (docs/vllm-serve.md): the cluster secret, the
agent priority's aging, the engine's spin and idle poll.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

from server.common.control_path import default_control_socket
from server.common.env import (
    ENV_ADVERTISE_URL,
    ENV_CLUSTER_NAME,
    ENV_CONTROL_SOCKET,
    ENV_INDEX_URL,
    ENV_ROLE,
)
from server.common.tenants import keys_of
from server.connector.config import ConnectorConfig

logger = logging.getLogger("kvbranch.plugin")

#: The kvbranch connector's class name in a kv-transfer-config (``kv_connector``).
CONNECTOR_NAME = "KVBranchConnector"
#: The role an instance has when the config names none, by vLLM's ``kv_role``.
ROLE_OF_KV_ROLE = {"kv_producer": "prefill", "kv_consumer": "decode"}
#: Composing connectors nest deeper than this only by mistake (or to make us recurse forever).
_MAX_DEPTH = 8


class VllmServeConfigError(ValueError):
    """A kv-transfer-config the plugin cannot serve safely; stops the server with one line."""


def _field(entry: Any, name: str) -> Any:
    """A field of vLLM's ``KVTransferConfig`` or of a child connector's dict."""
    return entry.get(name) if isinstance(entry, Mapping) else getattr(entry, name, None)


def find_kvbranch(kv_transfer_config: Any) -> tuple[Mapping[str, Any], str] | None:
    """The kvbranch connector's ``kv_connector_extra_config`` and the engine id it runs under
    (its own ``engine_id``, else its parent's, as vLLM's ``MultiConnector`` gives a child), or
    ``None`` when the config does not load it."""

    def walk(entry: Any, engine_id: Any, depth: int) -> tuple[Mapping[str, Any], str] | None:
        if depth > _MAX_DEPTH or entry is None:
            return None
        extra = _field(entry, "kv_connector_extra_config") or {}
        engine_id = _field(entry, "engine_id") or engine_id
        if _field(entry, "kv_connector") == CONNECTOR_NAME:
            return (extra if isinstance(extra, Mapping) else {}), str(engine_id or "")
        children = extra.get("connectors") if isinstance(extra, Mapping) else None
        for child in children if isinstance(children, list) else []:
            found = walk(child, engine_id, depth + 1)
            if found is not None:
                return found
        return None

    return walk(kv_transfer_config, None, 0)


def environment(args: Any) -> dict[str, str]:
    """The launcher's environment for the plugin, from vLLM's parsed arguments (its
    ``kv_transfer_config``): empty when the config does not load the kvbranch connector.
    Raises :class:`VllmServeConfigError` (or the connector's own config error) for a config
    that would run with less isolation than it says."""
    kv_transfer_config = getattr(args, "kv_transfer_config", None)
    found = find_kvbranch(kv_transfer_config)
    if found is None:
        return {}
    extra, engine_id = found
    config = ConnectorConfig.from_extra(extra)
    if keys_of(args) and not config.tenants:
        raise VllmServeConfigError(
            "the server has API keys but the kvbranch connector's kv_connector_extra_config "
            'lacks "tenants": true (a request that reached the engine without an owner would '
            "keep session state): add it (python -m server sets it whenever there are keys)"
        )
    env = {
        ENV_CONTROL_SOCKET: config.control_socket or default_control_socket(engine_id),
        ENV_ROLE: config.role
        or ROLE_OF_KV_ROLE.get(str(_field(kv_transfer_config, "kv_role")), "single"),
    }
    for name, value in (
        (ENV_INDEX_URL, config.index_url),
        (ENV_CLUSTER_NAME, config.cluster_name),
        (ENV_ADVERTISE_URL, config.advertise_url),
    ):
        if value is not None:
            env[name] = value
    return env


def apply_kv_transfer_config(args: Any) -> dict[str, str]:
    """Set each variable of :func:`environment` the launcher did not set (in this process:
    the API server's, where the plugin reads them). Returns what it set."""
    wanted = environment(args)
    added = {name: value for name, value in wanted.items() if not os.environ.get(name)}
    if ENV_CONTROL_SOCKET in added:
        from server.connector.control.transport import check_private_dir

        # The engine core bound it there already (it starts first) after the same check; a
        # directory someone else could swap must not receive session ops.
        check_private_dir(os.path.dirname(os.path.abspath(added[ENV_CONTROL_SOCKET])))
    os.environ.update(added)
    if added:
        logger.info(
            "kvbranch: settings from the kv-transfer-config (vLLM's own CLI): %s",
            ", ".join(f"{name}={value}" for name, value in sorted(added.items())),
        )
    return added
