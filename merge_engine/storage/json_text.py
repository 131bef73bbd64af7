"""The one guarded JSON parser: every JSON stepmerge reads (metadata, headers, manifests, claims, locks,
owner records, stage manifests, webhook bodies) is parsed by `parse_json`.

`parse_json(data, url, error=...)` returns the JSON value in ``data`` (str or bytes), or raises
``error(message, url)`` (a `StepmergeError` class, `CorruptShard` unless the caller names its own) when
- ``data`` is larger than `MAX_JSON_BYTES` (checked before any parsing: a crafted file cannot make
  the parser build an unbounded tree);
- it nests arrays/objects deeper than `MAX_JSON_DEPTH` (checked before parsing by a scan of the
  brackets outside strings, linear in time and constant in memory: `json_depth`; the deepest real metadata is
  about 6 levels). Python's own parser would
  raise ``RecursionError`` somewhere near 1000 levels, depending on how deep the caller's stack is:
  a limit of our own is the same everywhere, and ``RecursionError`` is still caught as a last guard;
- it is not valid UTF-8 JSON, or (``unique_keys``) an object names a key twice.
No other exception leaves it. It reads no file: `merge_engine.formats.json_file` reads files (any URL) with it;
what reads a local file only (stage manifests, temp-folder owners, locks) reads it with `read_local_json`,
which reads at most `MAX_JSON_BYTES` + 1 bytes.
"""

from __future__ import annotations

import json
import os
import re
import stat
from itertools import accumulate
from typing import Any

from merge_engine.errors import CorruptShard, StepmergeError

MAX_JSON_BYTES = 100_000_000  # the safetensors format's own header limit: the largest JSON stepmerge reads
MAX_JSON_DEPTH = 64

# the rest of a string after its opening quote; and text followed by whole strings: patterns that never
# backtrack (possessive), so their memory does not grow with a string's length or its escapes
_STRING_REST = rb'[^"\\]*+(?:\\.[^"\\]*+)*+"'
_STRING_END = re.compile(_STRING_REST, re.DOTALL)
_STRING = re.compile(b'"' + _STRING_REST, re.DOTALL)
_TEXT_AND_STRINGS = re.compile(b'(?:[^"]*+"' + _STRING_REST + b")*+", re.DOTALL)
_NOT_BRACKET = bytes(c for c in range(256) if c not in b"[]{}")
_STEP = tuple(1 if c in b"[{" else -1 if c in b"]}" else 0 for c in range(256))
_WINDOW = 1 << 16  # bytes looked at in one piece


def json_depth(data: bytes) -> int:
    """How deeply ``data`` nests arrays and objects (brackets inside strings do not count), up to the first
    window that goes over `MAX_JSON_DEPTH` (the scan stops there) or an unterminated string (the rest is
    that string; the parser refuses it).

    One pass, in time linear in ``len(data)`` and constant extra memory: the text is taken in windows of at
    most `_WINDOW` bytes that end outside a string (a longer string is skipped by a pattern, never copied).
    """
    depth = deepest = 0
    position, size = 0, len(data)
    while position < size:
        window = min(size, position + _WINDOW)
        end = _TEXT_AND_STRINGS.match(data, position, window).end()  # type: ignore[union-attr]  # the pattern matches the empty string  # after the last whole string in the window
        if end > position:
            text, after = _STRING.sub(b"", data[position:end]), end
        else:  # no whole string in the window: the text up to a quote (or the window's end), then one long string
            quote = data.find(b'"', position, window)
            end = after = window if quote < 0 else quote
            if quote >= 0:
                closed = _STRING_END.match(data, quote + 1)
                after = size if closed is None else closed.end()  # unterminated: not JSON, the parser says so
            text = data[position:end]
        levels = list(accumulate(map(_STEP.__getitem__, text.translate(None, _NOT_BRACKET)), initial=depth))
        depth, deepest = levels[-1], max(deepest, max(levels))
        if deepest > MAX_JSON_DEPTH:
            break
        position = after
    return deepest


def parse_json(data: str | bytes, url: str | None, *, error: type[StepmergeError] = CorruptShard,
               unique_keys: bool = False) -> Any:
    """The JSON value in ``data``; ``error`` naming ``url`` if it is too big, too deep or not valid JSON.

    ``unique_keys``: an object naming a key twice is ``error`` too. Python keeps the last value,
    other parsers (the safetensors library's) refuse or keep the first: a file two readers read
    differently is refused where that matters (tensor headers).
    """
    raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else data if isinstance(data, bytes) \
        else bytes(data)
    if len(raw) > MAX_JSON_BYTES:
        raise error(f"JSON of {len(raw)} bytes is too large to be metadata (limit {MAX_JSON_BYTES})", url)
    if json_depth(raw) > MAX_JSON_DEPTH:
        raise error(f"JSON nested too deeply to be metadata (more than {MAX_JSON_DEPTH} levels)", url)
    try:
        text = raw.decode("utf-8")
        return json.loads(text, object_pairs_hook=_unique_object) if unique_keys else json.loads(text)
    except RecursionError:
        raise error("JSON nested too deeply to be metadata", url) from None
    except _DuplicateKey as exc:
        raise error(f"JSON object names {exc.args[0]!r} twice", url) from None
    except ValueError as exc:  # also UnicodeDecodeError
        raise error(f"not valid JSON ({exc})", url) from None


def read_local_json(path: str, *, error: type[StepmergeError] = CorruptShard) -> Any:
    """The JSON value in the local file ``path``; ``error`` if it is not a regular file (a FIFO is never
    waited on: it is opened non-blocking and refused) or not acceptable JSON; ``FileNotFoundError``
    (and other ``OSError``) as ``open`` raises them. At most `MAX_JSON_BYTES` + 1 bytes are read."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise error("not a regular file", path)
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(MAX_JSON_BYTES + 1)
    finally:
        os.close(fd)
    return parse_json(data, path, error=error)


class _DuplicateKey(Exception):
    pass


def _unique_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise _DuplicateKey(key)
            seen.add(key)
    return out


__all__ = ["MAX_JSON_BYTES", "MAX_JSON_DEPTH", "json_depth", "parse_json", "read_local_json"]
