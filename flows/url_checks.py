"""Is a URL from a user, a form or a webhook safe to hand to storage? (No heavy imports: the webhook uses it.)

`checked_url` accepts a URL whose scheme is on an allow-list (or a local path, when allowed) and
that names a bucket, and refuses ``..`` components (also percent-encoded), backslashes and control
characters: parts of these URLs become object keys and paths, so nothing may climb out of them.
The allow-list is the storage scheme registry's (`merge_engine.storage.schemes.url_schemes`:
every store another process can reach), or a narrower list the caller passes.
"""

import re
from typing import Optional, Sequence

from merge_engine.storage.schemes import backend_for_scheme, url_schemes
from merge_engine.storage.urls import file_url_path

_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def checked_url(value: str, schemes: Optional[Sequence[str]] = None, allow_local_paths: bool = True) -> str:
    """``value`` if it is a safe storage URL (see the module docstring); else ValueError.

    ``schemes``: the allowed schemes; None: the registry's `url_schemes` (asked at each call)."""
    if schemes is None:
        schemes = url_schemes()
    if not isinstance(value, str) or not value.strip():
        raise ValueError("must be a non-empty URL")
    if _CONTROL.search(value) or "\\" in value:
        raise ValueError("must not contain control characters or backslashes")
    file_url_path(value)  # file://otherhost/x, file:x: UnsupportedScheme, a ValueError naming the URL
    if "://" in value:
        scheme, rest = value.split("://", 1)
        if scheme.lower() not in schemes:
            raise ValueError(f"scheme {scheme!r} is not allowed (allowed: {', '.join(schemes)})")
        if not backend_for_scheme(scheme).local and not rest.split("/", 1)[0]:
            raise ValueError("must name a bucket")
    elif not allow_local_paths:
        raise ValueError(f"must be a URL with one of the schemes {', '.join(schemes)}")
    else:
        rest = value
    decoded = rest.replace("%2e", ".").replace("%2E", ".").replace("%2f", "/").replace("%2F", "/")
    if any(part == ".." for part in decoded.split("/")):
        raise ValueError("must not contain '..' (path traversal)")
    return value.rstrip("/") if len(value) > 1 else value
