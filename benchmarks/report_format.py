"""How RESULTS.md and the README write a number: three significant digits, never in scientific
notation, a count as the whole number it is, a fraction as a percentage, a ratio as ``2.79x``.

Why one module: the headline, the sections and the README's figures must write the same record
the same way, or a reader comparing them sees two numbers where there is one.
"""

from __future__ import annotations

import math


def sig3(value: float) -> str:
    """``value`` to three significant digits without an exponent: 0.321611 -> 0.322,
    14.951 -> 15, 7531.9 -> 7532 (digits left of the point are kept), 10157 -> 10157."""
    value = float(value)
    if not math.isfinite(value):
        return "n/a"
    if value.is_integer():
        return str(int(value))
    magnitude = math.floor(math.log10(abs(value)))
    decimals = max(0, 2 - magnitude)
    text = f"{value:.{decimals}f}"
    if "." in text:
        text = text.rstrip("0").rstrip(".")
    return "0" if text in ("-0", "") else text


def fmt_value(value: float, unit: str) -> str:
    """A record's value with its unit, rounded for a reader (``0.322 s``, ``100%``, ``2.79x``)."""
    if not math.isfinite(value):
        return "n/a"
    if unit == "fraction":
        return f"{sig3(value * 100)}%"
    if unit in ("x", "%"):
        return f"{sig3(value)}{unit}"
    return f"{sig3(value)} {unit}" if unit else sig3(value)


def fmt_ratio(value: float | None) -> str:
    return "–" if value is None or not math.isfinite(value) else f"{sig3(value)}x"


def cell(text: str) -> str:
    """Text safe inside a Markdown table cell."""
    return " ".join(text.replace("|", "\\|").split())
