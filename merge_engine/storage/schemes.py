"""The scheme registry: which URL schemes stepmerge serves, and the backend for each.

It is the one list every URL check asks: the engine (`backend_for`, which raises
`UnsupportedScheme` naming the schemes served), the CLI through the engine, flow parameters
(the flows' URL check), Prefect result storage and the webhook
(`deployments.webhook`). The backends are the modules of `merge_engine.storage.backends`, each
defining ``BACKEND``; they are found by listing that package, so a new store is one new file.
Importing this module imports no storage client.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil

from merge_engine.errors import UnsupportedScheme
from merge_engine.storage import backends as _backends_package
from merge_engine.storage.backend import Backend
from merge_engine.storage.faults import transient_by
from merge_engine.storage.urls import scheme_of


@functools.cache
def _registry() -> dict[str, Backend]:
    """Scheme spelling -> backend, from every module in `merge_engine.storage.backends` (sorted by name)."""
    found: dict[str, Backend] = {}
    for module_info in sorted(pkgutil.iter_modules(_backends_package.__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{_backends_package.__name__}.{module_info.name}")
        backend = getattr(module, "BACKEND", None)
        if not isinstance(backend, Backend) or not backend.schemes:
            raise TypeError(f"{module.__name__} must define BACKEND, a Backend with at least one scheme")
        for scheme in backend.schemes:
            if scheme in found:
                raise TypeError(f"scheme {scheme!r} is served twice ({module.__name__} and another backend)")
            found[scheme] = backend
    return found


def registered_backends() -> tuple[Backend, ...]:
    """Every backend, once each."""
    return tuple(dict.fromkeys(_registry().values()))


def backend_for_scheme(scheme: str) -> Backend:
    """The backend serving ``scheme`` (a spelling, case-insensitive); `UnsupportedScheme` if none does."""
    backend = _registry().get(scheme.lower())
    if backend is None:
        raise UnsupportedScheme(
            f"no storage backend serves {scheme}:// (served: {', '.join(url_schemes(shared_only=False))})"
        )
    return backend


def backend_for(url: str) -> Backend:
    """The backend serving ``url`` (a plain path is local); `UnsupportedScheme` (with the URL) if none does."""
    scheme = scheme_of(url) or "file"  # a plain path is local; the URL's own checks come with its use
    try:
        return backend_for_scheme(scheme)
    except UnsupportedScheme as exc:
        raise UnsupportedScheme(exc.message, url) from None


def url_schemes(shared_only: bool = True) -> tuple[str, ...]:
    """Every scheme spelling accepted in URLs; ``shared_only``: only stores another process can reach.

    What a URL from a user, a form or a flow parameter may use.
    """
    return tuple(scheme for scheme, backend in _registry().items() if backend.shared or not shared_only)


def remote_schemes(canonical_only: bool = False) -> tuple[str, ...]:
    """Scheme spellings of the shared stores that are not this machine's filesystem (object stores).

    ``canonical_only``: one spelling per store (``s3``, ``gs``): where one spelling per store
    matters, e.g. the webhook, whose idempotency keys are made of the URL.
    """
    return tuple(
        scheme for scheme, backend in _registry().items()
        if backend.shared and not backend.local and (not canonical_only or scheme == backend.canonical_scheme)
    )


def is_transient(exc: BaseException) -> bool:
    """Whether retrying the failed storage call may succeed, judged by every backend's client rules.

    True for connection resets / refusals / drops, timeouts (incl. fsspec's ``FSTimeoutError``),
    throttling and server-side 5xx (S3 ``SlowDown`` / 503, GCS 429 / 503), aiohttp
    ``ClientPayloadError`` / ``ServerDisconnectedError``. False for ``FileNotFoundError``,
    ``PermissionError`` and every `StepmergeError`, and for anything not recognised. The chain of
    causes is followed (s3fs raises ``OSError`` *from* botocore's ``ClientError``): the first link
    that is recognised decides (`faults.transient_by`).
    """
    return transient_by(exc, [backend.classify_fault for backend in registered_backends()])
