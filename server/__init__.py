"""kvbranch server: vLLM's OpenAI-compatible server plus the kvbranch KV connector and routes.

Importing this package is cheap (no vLLM import); the engine-side pieces live in
``server.connector`` and the HTTP pieces in ``server.plugin``.
"""

from importlib.metadata import PackageNotFoundError, version

try:  # one version: the package's own (pyproject.toml)
    __version__ = version("kvbranch")
except PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"
