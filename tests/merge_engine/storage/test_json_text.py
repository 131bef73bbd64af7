"""`merge_engine.storage.json_text`: the depth check before parsing is one pass, linear in time, with constant
extra memory, whatever the strings it skips hold.

Specification:
- a JSON document holding one long string (plain, all escapes, or brackets) is parsed with a peak of under twice
  its size in extra memory (measured in a child process: its peak resident size before and after);
- brackets inside strings (after escaped quotes and backslashes, across the scan's windows) do not count; an
  unterminated string ends the scan (the parser refuses the text); depth over `MAX_JSON_DEPTH` is refused.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from merge_engine.errors import CorruptShard
from merge_engine.storage import json_text
from merge_engine.storage.json_text import MAX_JSON_DEPTH, json_depth, parse_json

STRING_BYTES = 4_000_000  # before: ~120 bytes of memory per byte of such a string (~480 MB here)

_CHILD = """
import resource, sys
from merge_engine.storage.json_text import parse_json
body = {"plain": b"x", "escapes": b"\\\\n", "brackets": b"[{"}[sys.argv[1]]
data = b'{"model_type": "qwen2", "pad": "' + body * (int(sys.argv[2]) // len(body)) + b'"}'
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
value = parse_json(data, "config.json")
assert value["model_type"] == "qwen2"
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024 / len(data))
"""


@pytest.mark.parametrize("string", ["plain", "escapes", "brackets"])
def test_a_long_string_costs_under_twice_its_size(string):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    ratio = float(subprocess.run([sys.executable, "-c", _CHILD, string, str(STRING_BYTES)], env=env, check=True,
                                 capture_output=True, text=True, timeout=120).stdout)
    assert ratio < 2, f"parsing a {STRING_BYTES} byte string took {ratio:.1f}x its size"


def test_brackets_in_strings_do_not_count(monkeypatch):
    monkeypatch.setattr(json_text, "_WINDOW", 16)  # strings and escapes across many windows
    for document in (["[[[", "]]]"], {'a\\"[': ["{{\\", [['"]]']]]}, "x" * 100, [[["\\\\"]], "[{"]):
        text = json.dumps(document).encode()
        assert json_depth(text) == _depth(document), text
    assert json_depth(b'["a\\"[[[[') == 1  # an unterminated string: the scan stops, the parser refuses it
    with pytest.raises(CorruptShard, match="not valid JSON"):
        parse_json(b'["a\\"[[[[', "x")


def _nested(levels: int) -> bytes:
    """An object (one level) with a string of closing brackets, then ``levels`` - 1 nested arrays."""
    return b'{"s": "' + b"]" * 1000 + b'", "a": ' + b"[" * (levels - 1) + b"]" * (levels - 1) + b"}"


@pytest.mark.parametrize("window", [16, 1 << 16])
def test_depth_over_the_limit_is_refused_within_a_window_or_across_windows(window, monkeypatch):
    monkeypatch.setattr(json_text, "_WINDOW", window)
    assert json_depth(_nested(MAX_JSON_DEPTH)) == MAX_JSON_DEPTH
    assert parse_json(_nested(MAX_JSON_DEPTH), "x")["s"] == "]" * 1000
    with pytest.raises(CorruptShard, match="nested too deeply"):
        parse_json(_nested(MAX_JSON_DEPTH + 1), "x")


def _depth(value) -> int:
    if isinstance(value, dict):
        return 1 + max(map(_depth, value.values()), default=0)
    if isinstance(value, list):
        return 1 + max(map(_depth, value), default=0)
    return 0
