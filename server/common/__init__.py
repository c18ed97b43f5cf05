"""Small pure helpers that several processes share: the router, vLLM's API server (the plugin),
the engine core, the launcher. They import only the standard library, sdk.contract and Starlette
(and httpx, pydantic: ``pin_follow``, one call between members that the router and the
plugin both make)."""
