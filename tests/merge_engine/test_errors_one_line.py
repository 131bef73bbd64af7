"""`merge_engine.errors.one_line`: what a message echoes from a user or a file is one bounded line."""

from __future__ import annotations

import pytest

from merge_engine.errors import CorruptShard, InvalidOption, one_line
from merge_engine.option_values import parse_dtype, parse_size, whole_number


def test_one_line_escapes_and_cuts():
    assert one_line("s3://bucket/run") == "s3://bucket/run"
    assert one_line("a\nb\u202ec") == "a\\nb\\u202ec"
    assert one_line("x" * 500, 100) == "x" * 100 + "... (400 more characters)"


def test_an_error_path_is_one_bounded_line():
    shown = str(CorruptShard("bad header", "s3://b/" + "x" * 5000 + "\nsecond line"))
    assert "\n" not in shown and len(shown) < 1300


@pytest.mark.parametrize("parse", [parse_dtype, parse_size, whole_number])
def test_an_option_value_is_echoed_on_one_bounded_line(parse):
    with pytest.raises(InvalidOption) as caught:
        parse("5" * 3000 + "\nQQ")
    assert "\n" not in str(caught.value) and len(str(caught.value)) < 300
