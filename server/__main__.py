"""``python -m server`` — see :mod:`server.cli`."""

from server.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
