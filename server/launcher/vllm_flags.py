"""Reading vLLM's own flags after ``--`` the way its parser would (long flags with dashes or
underscores, ``--flag value`` or ``--flag=value``, the last one winning; short flags), for the
launcher and ``--cluster``'s planner, which both decide by them. Standard library only."""

from __future__ import annotations


def flag_value(passthrough: list[str], flag: str) -> str | None:
    """The value of ``flag`` after ``--`` (``--flag value`` or ``--flag=value``, the last one
    wins; underscores too), or ``None``."""
    spellings = {flag, "--" + flag[2:].replace("-", "_")}
    value = None
    for i, arg in enumerate(passthrough):
        name, eq, rest = arg.partition("=")
        if name in spellings:
            value = rest if eq else (passthrough[i + 1] if i + 1 < len(passthrough) else "")
    return value


def short_flag_value(passthrough: list[str], flag: str) -> str | None:
    """The value of a short vLLM flag (``-tp 2`` or ``-tp=2``; the last one wins)."""
    value = None
    for i, arg in enumerate(passthrough):
        name, eq, rest = arg.partition("=")
        if name == flag:
            value = rest if eq else (passthrough[i + 1] if i + 1 < len(passthrough) else "")
    return value


def has_flag(passthrough: list[str], flag: str) -> bool:
    """``flag`` is among vLLM's arguments after ``--`` (also as ``--flag=value`` and with
    underscores, which vLLM's parser accepts too)."""
    spellings = {flag, "--" + flag[2:].replace("-", "_")}
    return any(a.partition("=")[0] in spellings for a in passthrough)


def data_parallel_size(passthrough: list[str]) -> int:
    """``--data-parallel-size`` (or ``-dp``) after ``--``; 1 without it."""
    value = flag_value(passthrough, "--data-parallel-size") or short_flag_value(passthrough, "-dp")
    return int(value) if value and value.isdigit() and int(value) > 0 else 1
