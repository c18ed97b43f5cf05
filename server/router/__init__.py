"""The P/D router's own process: edge, policy, relay, admin, membership (and its launching).
May import server.common, checks, dialects, index, the launcher, and two pure pieces of the
connector (tests/unit/test_server_folders.py names them); never the plugin or the engine.
"""
