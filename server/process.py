"""Old path of :mod:`server.launcher.process` (start and stop a real ``python -m server``), kept
while code with uncommitted changes imports it from here; new code imports the new path."""

from server.launcher.process import *  # noqa: F403
