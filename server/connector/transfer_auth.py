"""Compatibility shim: ``server.connector.transfer_auth`` was imported by deployments' scripts
and the router before the P/D split. The module lives in
:mod:`server.connector.pd.transfer_auth`; keep this a re-export only (it imports no vLLM)."""

from server.connector.pd import transfer_auth as _impl
from server.connector.pd.transfer_auth import *  # noqa: F403

globals().update({k: v for k, v in vars(_impl).items() if not k.startswith("__")})
