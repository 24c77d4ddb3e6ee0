"""agentd.digits: decimal text read without str.isdigit() then int() (which takes "²" and
refuses it, reads "٣" as 3, and refuses over 4300 digits)."""

from __future__ import annotations

import pytest

from agentd.digits import ascii_digits, whole_number


@pytest.mark.parametrize("text", ["", "²", "٣", "1٣", "-1", "+1", " 1", "1 ", "1_000", "0x10", "1.0", "١٢"])
def test_anything_but_ascii_digits_is_no_number(text):
    assert not ascii_digits(text)
    assert whole_number(text, 20) is None
    assert whole_number(text, 20, zeros=True) is None


def test_a_number_of_at_most_so_many_digits_is_read():
    assert ascii_digits("0123456789")
    assert whole_number("0", 1) == 0
    assert whole_number("65535", 5) == 65535
    assert whole_number("123456", 5) is None
    assert whole_number("9" * 5000, 5) is None  # not int()'s ValueError


def test_leading_zeros_count_unless_told_not_to():
    assert whole_number("00080", 3) is None
    assert whole_number("00080", 3, zeros=True) == 80
    assert whole_number("0" * 5000 + "80", 5, zeros=True) == 80
    assert whole_number("0" * 5000, 5, zeros=True) == 0
    assert whole_number("0" * 5000 + "123456", 5, zeros=True) is None
