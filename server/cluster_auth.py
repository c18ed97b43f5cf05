"""Old path of :mod:`server.common.cluster_auth` (the router's proof for P and D), kept while
code with uncommitted changes imports it from here; new code imports the new path."""

from server.common.cluster_auth import *  # noqa: F403
