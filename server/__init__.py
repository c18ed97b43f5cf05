"""kvbranch server: vLLM's OpenAI-compatible server plus the kvbranch KV connector and routes.

Importing this package is cheap (no vLLM import); the engine-side pieces live in
``server.connector`` and the HTTP pieces in ``server.plugin``.
"""

__version__ = "0.1.0"
