"""Small JSON metadata files (``ckpt_contents.json``, ``metadata.json``, ``transformer_config.json``, ...).

`read_json_object(url, error=...)`: the file's JSON object; None when the file does not exist;
``error(message, url)`` (a `StepmergeError` class, `CorruptShard` unless the caller names its own)
when it is not valid UTF-8 JSON or not an object. One reader, so every caller reports a broken
file the same way, with the file's URL.
"""

from __future__ import annotations

import json
from typing import Any

from merge_engine import storage
from merge_engine.errors import CorruptShard, StepmergeError


def read_json_object(url: str, *, error: type[StepmergeError] = CorruptShard) -> dict[str, Any] | None:
    """The JSON object in ``url``; None if absent; ``error`` if unparsable or not an object."""
    try:
        data = json.loads(storage.read_text(url))
    except FileNotFoundError:
        return None
    except ValueError as exc:  # also UnicodeDecodeError
        raise error(f"not valid JSON ({exc})", url) from None
    if not isinstance(data, dict):
        raise error(f"not a JSON object (a {type(data).__name__})", url)
    return data
