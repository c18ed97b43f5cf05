"""Request rules both doors apply: run in the router's process and in vLLM's API server (the
plugin's guard). Pure; may import sdk.contract, server.dialects and server.common only.

What a client may send, checked the same way at both of the cluster's doors: the router
(:mod:`server.router.edge`) and each instance's guard (:mod:`server.plugin.guard`).

Pure functions over a request's headers and parsed body — no FastAPI, no vLLM — so the router
imports them without the plugin, and a rule is written once: a request the router lets through
is one the instances accept, and one they refuse is refused at the router before any leg runs.
May import: :mod:`sdk.contract`, :mod:`server.dialects`, :mod:`server.common.tenants`.
"""
