"""Small JSON metadata files (``ckpt_contents.json``, ``metadata.json``, ``config.json``, indexes, ...),
read from any URL and parsed by the one guarded parser (`merge_engine.storage.json_text.parse_json`:
bounded size and depth), so every caller reports a broken file the same way, with the file's URL:

- `read_json(url, error=...)`: the JSON value in the file; None when it does not exist; ``error(message,
  url)`` (a `StepmergeError` class, `CorruptShard` unless the caller names its own) when it is too
  large, nested too deeply, or not valid UTF-8 JSON;
- `read_json_object(url, error=...)`: `read_json`, and ``error`` unless the value is an object.
"""

from __future__ import annotations

from typing import Any

from merge_engine import storage
from merge_engine.errors import CorruptShard, StepmergeError
from merge_engine.storage.json_text import parse_json


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


__all__ = ["read_json", "read_json_object"]
