"""Runs inside vLLM's engine-core process (warm-first scheduler, its counters, the store reset on
new weights), plus the patches every vLLM process installs (message-queue spin, idle poll).
May import server.common, server.connector and vLLM; never the plugin, the router or the launcher.
"""
