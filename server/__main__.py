"""``python -m server`` — see :mod:`server.launcher.cli`."""

from server.launcher.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
