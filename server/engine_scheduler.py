"""Old path of :mod:`server.engine.scheduler`, kept because users name it:
``--scheduler-cls server.engine_scheduler.WarmFirstScheduler`` (after ``--``) still loads the
warm-first scheduler. Imports vLLM, like the module it stands for."""

from server.engine.scheduler import *  # noqa: F403
