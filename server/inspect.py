"""``python -m server.inspect``: the documented command (README.md) for
:mod:`server.tools.inspect`, which holds the code."""

from server.tools.inspect import *  # noqa: F403
from server.tools.inspect import main

if __name__ == "__main__":
    raise SystemExit(main())
