"""The launcher's spread of one OpenMP core list over data-parallel engines."""

from __future__ import annotations

import pytest

from server.launcher.cpu_binding import engine_binding, parse_cores


@pytest.mark.parametrize(
    ("mask", "engines", "bound"),
    [
        ("0", 1, "0"),
        ("0", 2, "0|0"),  # fewer cores than engines: each keeps the list (same thread count)
        ("0,1", 3, "0,1|0,1|0,1"),
        ("0-3", 2, "0,1|2,3"),
        ("0-4", 2, "0,1|2,3"),  # equal shares; the odd core is left out
        ("3,1,2,0", 4, "0|1|2|3"),
        ("0|1", 2, "0|1"),  # the user's own mapping
        ("auto", 2, "auto"),
        ("nobind", 2, "nobind"),
    ],
)
def test_engine_binding(mask, engines, bound):
    assert engine_binding(mask, engines) == bound


@pytest.mark.parametrize("mask", ["", "a", "3-1", "-1", "0,,1"])
def test_unreadable_lists_are_refused(mask):
    with pytest.raises(ValueError):
        parse_cores(mask)
    with pytest.raises(ValueError):
        engine_binding(mask, 2)


def test_ranges_are_read_as_vllm_reads_them():
    assert parse_cores("0-2,5,1") == [0, 1, 2, 5]
