"""Old path of :mod:`server.engine.spin`, kept because an installed copy of kvbranch may still
register ``server.engine_spin:install`` as its ``vllm.general_plugins`` entry point (until it is
reinstalled; pyproject.toml names the new path)."""

from server.engine.spin import *  # noqa: F403
