"""Integration modules that share one keyed single server (several API keys, tenant quotas):
started once for this package and stopped when its last module ends, so it never sits beside
the later modules' servers (:mod:`tests.integration.keyed.server`)."""
