"""Tenants: when vLLM requires API keys, each key is a tenant.

Whose keys: exactly the ones vLLM's own ``AuthenticationMiddleware`` accepts — its
``--api-key`` list, else ``VLLM_API_KEY`` — read from the app's parsed arguments
(``app.state.args``). So tenancy is on however the keys were given (the launcher's
``--api-key``, keys after ``--``, a vLLM config file, the environment, or ``vllm serve`` with
the plugin). Without app arguments (unit tests), the launcher's ``KVBRANCH_API_KEYS``.

A tenant's id (``owner``) is a digest of its key (:func:`server.common.tenants.tenant_id`, the
digest the router scopes its index with too) — the key itself is never stored or logged.
It scopes sessions (each tenant has its own id space) and salts the prefix cache, combined
with any ``cache_salt`` the client sends (:func:`tenant_salt`). A header that does not carry a
configured key has no owner: the guard refuses it on every generating route.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

from server.common.env import ENV_API_KEYS  # the launcher sets it from the keys it saw
from server.common.tenants import DIGEST_CHARS, KeyTable, keys_of, tenant_id

__all__ = ["app_args_of", "keys_of", "owner_of", "tenancy_on", "tenant_id", "tenant_salt"]

#: id(args) -> (args, its key table); keeping args alive keeps its id unique.
_CACHE: dict[int, tuple[Any, KeyTable]] = {}


def _table(app_args: Any) -> KeyTable:
    if app_args is None:
        return KeyTable(os.environ.get(ENV_API_KEYS, "").split(","))
    cached = _CACHE.get(id(app_args))
    if cached is None or cached[0] is not app_args:
        cached = _CACHE[id(app_args)] = (app_args, KeyTable(keys_of(app_args)))
    return cached[1]


def app_args_of(scope_or_app: Any) -> Any:
    """vLLM's parsed arguments from an ASGI scope (dict) or a FastAPI app, if any."""
    app = scope_or_app.get("app") if isinstance(scope_or_app, dict) else scope_or_app
    state = getattr(app, "state", None)
    return getattr(state, "args", None) if state is not None else None


def tenancy_on(app_args: Any = None) -> bool:
    return bool(_table(app_args))


def owner_of(authorization: str | None, app_args: Any = None) -> str | None:
    """The tenant of a configured bearer key (:meth:`server.common.tenants.KeyTable.owner`)."""
    return _table(app_args).owner(authorization)


def tenant_salt(owner: str, client_salt: Any) -> str:
    """The prefix-cache salt of a tenant's request: the tenant's id, plus a digest of the
    client's own salt when it sent one. Two tenants never share a salt whatever their clients
    send, one tenant's clients can still split its cache, and the result always passes vLLM's
    salt check (at most 67 characters of ``[0-9a-z_.]``)."""
    if client_salt is None or client_salt == "":
        return owner
    text = client_salt if isinstance(client_salt, str) else repr(client_salt)
    return f"{owner}.{hashlib.sha256(text.encode()).hexdigest()[:DIGEST_CHARS]}"
