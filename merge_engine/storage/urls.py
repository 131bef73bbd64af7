"""URL spelling: scheme and path, local paths, and joining untrusted relative parts onto a URL.

A plain path (no ``://``) is a local path; ``file://`` and ``local://`` name local paths too
(`LOCAL_SCHEMES`, which the local backend serves). Everything else is ``<scheme>://<rest>``; which
schemes are served is the registry's business (`merge_engine.storage.schemes`), not this module's.
"""

from __future__ import annotations

import os
import posixpath

LOCAL_SCHEMES = ("file", "local")  # the spellings of a local path; "file" is the canonical one


def split_scheme(url: str) -> tuple[str, str]:
    """``"s3://b/k"`` -> ``("s3", "b/k")``; a plain path or ``file://`` URL -> ``("file", abs path)``."""
    if "://" not in url:
        return "file", os.path.abspath(url)
    scheme, rest = url.split("://", 1)
    if scheme in LOCAL_SCHEMES:
        return "file", os.path.abspath("/" + rest.lstrip("/")) if rest else "/"
    return scheme, rest


def is_local(url: str) -> bool:
    return split_scheme(url)[0] == "file"


def local_path(url: str) -> str:
    """The filesystem path of a local URL. Raises ValueError for a remote one."""
    scheme, path = split_scheme(url)
    if scheme != "file":
        raise ValueError(f"not a local path: {url}")
    return path


def join(url: str, *parts: str) -> str:
    """Join relative path components onto a URL with ``/``.

    Raises ValueError for a ``..`` component or an absolute part (``/etc``), either of which would
    leave ``url``: parts come from listings, manifests and webhooks, so they are not trusted.
    """
    for part in parts:
        if part.startswith("/") or part.startswith("\\"):
            raise ValueError(f"absolute path component {part!r}")
        for piece in part.replace("\\", "/").split("/"):
            if piece == "..":
                raise ValueError(f"path traversal in {part!r}")
    if is_local(url) and "://" not in url:
        return os.path.join(url, *parts)
    return posixpath.join(url.rstrip("/"), *parts)
