"""The server's layers import downwards only (issue 15). The graph, and the check that the
whole tree has no import cycles, are :mod:`tests.unit.test_cycles`.
"""

from __future__ import annotations

from tests.unit.test_cycles import import_graph


def test_the_graph_has_the_known_edges():
    graph = import_graph()
    assert "server.plugin.cluster_gate" in graph["server.plugin.guard"]
    assert "server.launcher.settings" in graph["server.launcher.cli"]


def test_layers_import_downwards_only():
    """The plugin reads the launcher's environment (server.common.env), not the launcher; the
    router builds its errors, tenants and stream rewrites without the plugin (or vLLM's engine);
    the cache-hint dialects both of them call import nothing of the server but themselves."""
    graph = import_graph()
    for name, imports in graph.items():
        if name.startswith("server.plugin"):
            assert "server.launcher.cli" not in imports, name
        if name.startswith("server.router"):
            assert not {m for m in imports if m.startswith("server.plugin")}, name
        if name.startswith("server.dialects"):  # pure: the router and the plugin share it
            assert all(m.startswith(("server.dialects", "sdk.contract")) for m in imports), name
