"""URL spelling: scheme and path, local paths, and joining untrusted relative parts onto a URL.

A plain path (no scheme) is a local path; ``file:`` and ``local:`` URLs name local paths too
(`LOCAL_SCHEMES`, which the local backend serves). Everything else is ``<scheme>://<rest>``; which
schemes are served is the registry's business (`merge_engine.storage.schemes`), not this module's.
Schemes are case-insensitive (``S3://``, ``FILE:///x``) and returned in lower case.

``file:`` URLs follow RFC 8089 (`split_scheme`): ``file:///x``, ``file://localhost/x`` and ``file:/x``
all name ``/x``; ``file://otherhost/x`` names another machine's file, which this machine cannot
write: `UnsupportedScheme` (naming the URL), never a folder called ``otherhost`` or ``file:``. A
``file:`` URL without an absolute path (``file:x``) is refused the same way. Percent-encoding in
paths is not decoded (a ``%`` is a ``%``).
"""

from __future__ import annotations

import os
import posixpath
import re

from merge_engine.errors import UnsupportedScheme

LOCAL_SCHEMES = ("file", "local")  # the spellings of a local path; "file" is the canonical one
_AUTHORITY_URL = re.compile(r"([A-Za-z][A-Za-z0-9+.\-]*)://(.*)", re.DOTALL)
_LOCAL_URL = re.compile(r"(file|local):(.*)", re.IGNORECASE | re.DOTALL)  # file:/x (RFC 8089: no authority)


def scheme_of(url: str) -> str | None:
    """The scheme of ``url`` in lower case (``"S3://b"`` -> ``"s3"``, ``"file:/x"`` -> ``"file"``), or None
    for a plain path."""
    match = _AUTHORITY_URL.fullmatch(url) or _LOCAL_URL.fullmatch(url)
    return match[1].lower() if match else None


def file_url_path(url: str) -> str | None:
    """The path a local URL names, as spelled (``"file://localhost/a/./b"`` -> ``"/a/./b"``: not
    normalised), or None when ``url`` is not a local URL (a plain path, another scheme).

    RFC 8089 (see the module docstring): `UnsupportedScheme` for ``file://otherhost/x`` and for a
    ``file:`` URL without an absolute path.
    """
    match = _AUTHORITY_URL.fullmatch(url)
    if match:
        scheme, rest = match[1].lower(), match[2]
        if scheme not in LOCAL_SCHEMES:
            return None
        host, _, path = rest.partition("/")
        if host.lower() not in ("", "localhost"):
            raise UnsupportedScheme(f"a {scheme}:// URL names a file on host {host!r}, not on this machine: write "
                                    f"{scheme}:///path, {scheme}://localhost/path or a plain path", url)
        return "/" + path.lstrip("/")
    match = _LOCAL_URL.fullmatch(url)
    if match:
        scheme = match[1].lower()
        if not match[2].startswith("/"):
            raise UnsupportedScheme(f"a {scheme}: URL must hold an absolute path ({scheme}:/path or {scheme}:///path)",
                                    url)
        return "/" + match[2].lstrip("/")
    return None


def split_scheme(url: str) -> tuple[str, str]:
    """``"s3://b/k"`` -> ``("s3", "b/k")``; a plain path or a local URL -> ``("file", abs path)``.

    Local URLs per RFC 8089 (`file_url_path`; `UnsupportedScheme` for ``file://otherhost/x`` and for a
    ``file:`` URL without an absolute path).
    """
    path = file_url_path(url)
    if path is not None:
        return "file", os.path.abspath(path)
    match = _AUTHORITY_URL.fullmatch(url)
    if match:
        return match[1].lower(), match[2]
    return "file", os.path.abspath(url)


def is_machine_path(value: str) -> bool:
    """Is ``value`` a path of this machine: absolute (``/x``, ``C:\\x``) or a local URL (``file:///x``)?"""
    return value.startswith(("/", "\\")) or re.match(r"[A-Za-z]:[\\/]", value) is not None \
        or scheme_of(value) in LOCAL_SCHEMES


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
    if scheme_of(url) is None:
        return os.path.join(url, *parts)
    return posixpath.join(url.rstrip("/"), *parts)
