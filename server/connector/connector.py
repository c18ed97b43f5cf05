"""Compatibility shim: ``server.connector.connector`` is the ``kv_connector_module_path`` that
users' vLLM configs and our launcher (``settings.CONNECTOR_MODULE``) name. The class lives in
:mod:`server.connector.engine.connector`; keep this module a re-export only."""

from server.connector.engine.connector import KVBranchConnector

__all__ = ["KVBranchConnector"]
