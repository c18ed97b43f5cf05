"""kvbranch's log lines print as vLLM's do, in every vLLM process kvbranch runs in.

vLLM configures its own ``vllm`` logger (its handler, format and ``VLLM_LOGGING_LEVEL``) and
leaves the root logger alone. The ``kvbranch.*`` loggers of the plugin (API server) and the
connector (engine core, workers) then had no handler: Python's last resort printed their
warnings bare and dropped every info line, so an operator never saw "kvbranch peer pulls on",
the control socket's path, or why a peer's claim failed. :func:`install` (a vLLM general
plugin, run in each of those processes) hands the ``kvbranch`` logger vLLM's handlers and
level; the API server configures vLLM's logging only after its general plugins ran, so the
endpoint plugin calls :func:`follow_vllm_logging` again when it attaches its routes. The
router and the launcher are no vLLM processes: they configure their own logging.
"""

from __future__ import annotations

import logging

#: The general plugin's name (``pyproject.toml``; the launcher names it in ``VLLM_PLUGINS``).
PLUGIN_NAME = "kvbranch_logging"
#: The parent of every logger kvbranch's server code uses (``kvbranch.peer_pull``, ...).
OURS = "kvbranch"
VLLM = "vllm"


def follow_vllm_logging() -> bool:
    """Give the ``kvbranch`` logger vLLM's handlers and level; True when it did. Once per
    process (a second call finds the handlers there); nothing when vLLM configured no handler
    (``VLLM_CONFIGURE_LOGGING=0``, or a logging config file of the user's): Python's own
    rules then apply, as they do to any library."""
    ours = logging.getLogger(OURS)
    theirs = logging.getLogger(VLLM)
    if ours.handlers or not theirs.handlers:
        return False
    for handler in theirs.handlers:
        ours.addHandler(handler)
    ours.setLevel(theirs.level)
    ours.propagate = False
    return True


def install() -> None:
    """vLLM general-plugin entry point (the API server, the engine core, every worker)."""
    follow_vllm_logging()
