"""``python -m server.model_cache [prepare|path|verify]``: the documented command (scripts/setup.sh,
docs/configuration.md) for :mod:`server.launcher.model_cache`, which holds the code."""

from server.launcher.model_cache import *  # noqa: F403
from server.launcher.model_cache import main

if __name__ == "__main__":
    raise SystemExit(main())
