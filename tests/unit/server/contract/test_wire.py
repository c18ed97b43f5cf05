"""sdk.contract.wire: the id and salt checks take the whole value."""

from __future__ import annotations

import pytest

from sdk.contract.wire import check_cache_salt, check_id, has_lone_surrogate


@pytest.mark.parametrize("value", ["abc", "a" * 128, "A.b_c:d-1", "0"])
def test_good_ids(value):
    assert check_id(value) == value


@pytest.mark.parametrize(
    "value",
    ["abc\n", "abc\n\n", "\nabc", "abc\r", "a b", "", "-a", "a" * 129, "a" * 128 + "\n", "é"],
)
def test_bad_ids_even_with_a_trailing_newline(value):
    with pytest.raises(ValueError) as exc:
        check_id(value, "session_id")
    assert "session_id" in str(exc.value)


def test_a_non_string_id_is_refused():
    with pytest.raises(ValueError):
        check_id(5, "x")  # type: ignore[arg-type]


def test_cache_salt_refuses_a_lone_surrogate_with_an_encodable_message():
    check_cache_salt("fine-salt")
    check_cache_salt("é😀")
    with pytest.raises(ValueError) as exc:
        check_cache_salt("salt\ud800")
    assert "surrogate" in str(exc.value)
    str(exc.value).encode("utf-8")
    assert has_lone_surrogate("\udfff") and not has_lone_surrogate("😀")
