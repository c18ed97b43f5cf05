"""The one installer of the engine plugins' vLLM patches (:mod:`server.engine.idle`,
:mod:`server.engine.spin`): each wraps one method of one vLLM class with a wait whose length the
launcher passed in an environment variable.

What both need, written once: read the variable (unset or not a number: leave vLLM as it is);
find the class (another vLLM version may not have it, or have it in another shape: log that and
leave it); wrap the method once per process however often the plugin runs (a second install
only updates the value the wrapper reads); keep the original's docstring.
"""

from __future__ import annotations

import importlib
import logging
import os
from collections.abc import Callable
from typing import Any, NamedTuple

logger = logging.getLogger("kvbranch.engine_patch")

#: ``wrap(original, seconds)``: the replacement method; ``seconds()`` is the value of the latest
#: install (read it on each call, not once).
Wrap = Callable[[Callable[..., Any], Callable[[], float]], Callable[..., Any]]


def seconds_from_env(name: str, what: str) -> float | None:
    """A non-negative number of seconds the launcher put in ``name``, or ``None`` when it is
    unset or not a number (then ``what`` is left as vLLM has it)."""
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return None
    try:
        value = float(raw)
    except ValueError:
        logger.warning("kvbranch: %s=%r is not a number; %s left as it is", name, raw, what)
        return None
    return max(value, 0.0)


class MethodPatch(NamedTuple):
    """The vLLM method a plugin wraps, as its module declares it: ``method``, its dotted name
    (``"module.Class.method"``); ``needs``, another attribute of the class the wrapper relies
    on (without it, or without the method, the class is not the one the patch was written
    for); ``what`` the log calls the patch."""

    method: str
    needs: str
    what: str


def install_patch(
    patch: MethodPatch, *, seconds: float | None, wrap: Wrap, log: logging.Logger = logger
) -> bool:
    """Wrap ``patch``'s method with ``wrap`` for ``seconds``. ``seconds`` ``None``, or a class
    other than the one the patch was written for: nothing changes. Returns whether the method
    is wrapped afterwards."""
    if seconds is None:
        return False
    target, _, method = patch.method.rpartition(".")
    module_name, _, class_name = target.rpartition(".")
    what = patch.what
    try:
        klass = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError):
        log.info("kvbranch: no vLLM %s here; %s unchanged", class_name, what)
        return False
    original = getattr(klass, method, None)
    if original is None or not hasattr(klass, patch.needs):
        log.info("kvbranch: unexpected vLLM %s; %s unchanged", class_name, what)
        return False
    marker = f"_kvbranch_{method.strip('_')}_s"
    if getattr(original, marker, None) is not None:
        setattr(original, marker, seconds)  # installed before in this process: the new value
        return True

    def current() -> float:
        return float(getattr(patched, marker))

    patched = wrap(original, current)
    setattr(patched, marker, seconds)
    patched.__doc__ = original.__doc__
    setattr(klass, method, patched)
    log.debug("kvbranch: %s %.4f s", what, seconds)
    return True
