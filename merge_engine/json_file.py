"""Small JSON metadata files (``ckpt_contents.json``, ``metadata.json``, ``config.json``, indexes, ...).

One parser, so every caller reports a broken file the same way, with the file's URL:

- `parse_json(data, url, error=...)`: the JSON value in ``data`` (str or bytes); ``error(message,
  url)`` (a `StepmergeError` class, `CorruptShard` unless the caller names its own) when it is not
  valid UTF-8 JSON — including JSON nested so deeply that Python's parser gives up
  (``RecursionError``), which a crafted file can do in a few kilobytes;
- `read_json(url, error=...)`: the same for a file; None when the file does not exist;
- `read_json_object(url, error=...)`: `read_json`, and ``error`` unless the value is an object.
"""

from __future__ import annotations

import json
from typing import Any

from merge_engine import storage
from merge_engine.errors import CorruptShard, StepmergeError


def parse_json(data: str | bytes, url: str | None, *, error: type[StepmergeError] = CorruptShard,
               unique_keys: bool = False) -> Any:
    """The JSON value in ``data``; ``error`` naming ``url`` if it is not valid (or too deeply nested) JSON.

    ``unique_keys``: an object naming a key twice is ``error`` too. Python keeps the last value,
    other parsers (the safetensors library's) refuse or keep the first: a file two readers read
    differently is refused where that matters (tensor headers).
    """
    try:
        text = data.decode("utf-8") if isinstance(data, bytes) else data
        return json.loads(text, object_pairs_hook=_unique_object) if unique_keys else json.loads(text)
    except RecursionError:
        raise error("JSON nested too deeply to be metadata", url) from None
    except _DuplicateKey as exc:
        raise error(f"JSON object names {exc.args[0]!r} twice", url) from None
    except ValueError as exc:  # also UnicodeDecodeError
        raise error(f"not valid JSON ({exc})", url) from None


class _DuplicateKey(Exception):
    pass


def _unique_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        raise _DuplicateKey(next(k for k, _ in pairs if k in seen or seen.add(k)))
    return out


def read_json(url: str, *, error: type[StepmergeError] = CorruptShard) -> Any:
    """The JSON value in the file ``url``; None if absent; ``error`` if unparsable."""
    try:
        data = storage.read_bytes(url)
    except FileNotFoundError:
        return None
    return parse_json(data, url, error=error)


def read_json_object(url: str, *, error: type[StepmergeError] = CorruptShard) -> dict[str, Any] | None:
    """The JSON object in ``url``; None if absent; ``error`` if unparsable or not an object."""
    data = read_json(url, error=error)
    if data is not None and not isinstance(data, dict):
        raise error(f"not a JSON object (a {type(data).__name__})", url)
    return data
