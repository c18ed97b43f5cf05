"""Session and branch ids, from every place a request names them.

A generating request names its session in the body (``session_id``), the ``X-Session-ID``
header or the extension args (vLLM's own three sources), and its branch in the extension args
(``kvbranch_branch``) or the ``X-KVBranch-Branch`` header. Each must be a
:func:`sdk.contract.check_id` id (1-128 characters of ``[A-Za-z0-9._:-]``): a session id no
route can address (``../x``, a space, 2 MB, a lone surrogate) would create a session — and
pin its blocks, and key the router's index — that nobody could ever get or delete, and a value
that cannot be encoded breaks every digest of it (a 500, not the client's error).
"""

from __future__ import annotations

from typing import Any

from sdk.contract import (
    BRANCH_HEADER,
    BRANCH_XARG,
    EXTRA_ARGS_FIELD,
    GENERATE_PATHS,
    NESTED_XARGS_PATH,
    NO_XARGS_PATHS,
    SAMPLING_PARAMS_FIELD,
    SESSION_FIELD,
    SESSION_HEADER,
    SESSION_XARG,
    XARGS_FIELD,
    check_id,
)

__all__ = ["id_problem", "xargs_of"]

#: At most this much of a bad value is echoed in a 400 (a 2 MB id is not sent back whole).
MESSAGE_CHARS = 300


def xargs_of(payload: dict, path: str) -> Any:
    """The client's extension args on this route (``None`` when absent or not accepted)."""
    if path in NO_XARGS_PATHS:
        return None
    if path == NESTED_XARGS_PATH:
        params = payload.get(SAMPLING_PARAMS_FIELD)
        return params.get(EXTRA_ARGS_FIELD) if isinstance(params, dict) else None
    return payload.get(XARGS_FIELD)


def id_problem(
    payload: dict,
    session_header: str | None,
    branch_header: str | None,
    path: str = GENERATE_PATHS[0],
) -> tuple[str, str] | None:
    """(param, message) for the first malformed session/branch id of a generating request, or
    None. Empty or absent ids mean "none" (as in vLLM and the planner)."""
    xargs = xargs_of(payload, path)
    xargs = xargs if isinstance(xargs, dict) else {}
    where = (
        f"{SAMPLING_PARAMS_FIELD}.{EXTRA_ARGS_FIELD}" if path == NESTED_XARGS_PATH else XARGS_FIELD
    )
    candidates = [
        (SESSION_FIELD, payload.get(SESSION_FIELD)),
        (SESSION_HEADER, session_header),
        (f"{where}.{SESSION_XARG}", xargs.get(SESSION_XARG)),
        (f"{where}.{BRANCH_XARG}", xargs.get(BRANCH_XARG)),
        (BRANCH_HEADER, branch_header),
    ]
    for param, value in candidates:
        if value is None or value == "":
            continue
        if param == SESSION_FIELD and not isinstance(value, str):
            continue  # vLLM's own request model rejects it with its message
        if param == f"{where}.{SESSION_XARG}" and not isinstance(value, str):
            continue  # vLLM ignores a non-string one
        try:
            check_id(value, param)
        except ValueError as exc:
            return param, str(exc)[:MESSAGE_CHARS]
    return None
