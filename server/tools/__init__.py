"""Command-line tools a person runs against a running server or router (``python -m
server.inspect``): HTTP clients of the public routes. May import sdk.contract and httpx only.
"""
