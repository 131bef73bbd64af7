"""`merge_engine.formats.json_file.read_json_object`: None when absent, the caller's error (naming the file)
when the file is not UTF-8 JSON or not an object."""

from __future__ import annotations

import pytest

from merge_engine.errors import CorruptShard, InvalidConfig
from merge_engine.formats.json_file import read_json, read_json_object
from merge_engine.storage.json_text import parse_json


def test_read_json_object(tmp_path):
    path = tmp_path / "config.json"
    assert read_json_object(str(path)) is None
    path.write_text('{"a": 1}')
    assert read_json_object(str(path)) == {"a": 1}
    for bad, match in ((b"{not json", "not valid JSON"), (b"\xff\xfe", "not valid JSON"), (b"[1, 2]", "not a JSON object")):
        path.write_bytes(bad)
        with pytest.raises(CorruptShard, match=match) as info:
            read_json_object(str(path))
        assert info.value.path == str(path)
    with pytest.raises(InvalidConfig):
        read_json_object(str(path), error=InvalidConfig)


def test_deeply_nested_json_is_a_named_error_not_a_recursion_error(tmp_path):
    """Case 11: ``[[[[...]]]]`` 100 000 deep (200 KB) makes Python's parser raise RecursionError; it is
    reported as the caller's named error, naming the file."""
    path = tmp_path / "config.json"
    path.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(InvalidConfig, match="nested too deeply") as info:
        read_json_object(str(path), error=InvalidConfig)
    assert info.value.path == str(path)
    path.write_text('{"a": ' * 100_000 + "1" + "}" * 100_000)
    with pytest.raises(CorruptShard, match="nested too deeply"):
        read_json(str(path))
    assert parse_json(b'{"a": [1]}', "x") == {"a": [1]}
