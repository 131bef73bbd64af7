"""Which storage faults are transient (`transient_by`), and retrying a call on them (`retrying`).

A fault is classified by the first link of its cause chain that says anything: the Python
builtins first (a `StepmergeError` or a missing file is permanent, a timeout or a dropped
connection transient), then the storage clients' own errors (the ``classifiers`` given: a
backend retries with its own `Backend.classify_fault`, e.g. botocore's for S3; the public
`merge_engine.storage.is_transient` asks every registered backend's), then the HTTP libraries the
clients share (aiohttp, requests, urllib3, http.client) and network ``errno`` values.
Anything not recognised is permanent. This module knows no backend: the registry sits above it.
"""

from __future__ import annotations

import errno as errno_codes
import logging
import random
import sys
import time
from collections.abc import Callable, Sequence
from typing import Optional, TypeVar

from merge_engine.errors import CredentialsMissing, StepmergeError, StorageUnavailable
from merge_engine.storage import tuning

logger = logging.getLogger("merge_engine.storage")

_T = TypeVar("_T")
Classifier = Callable[[BaseException], Optional[bool]]  # True transient, False permanent, None: not its error

RETRY_STATUSES = frozenset({408, 429, 500, 502, 503, 504})  # HTTP statuses worth a retry, on every store
_NETWORK_ERRNOS = frozenset({
    errno_codes.ECONNRESET, errno_codes.ECONNREFUSED, errno_codes.ECONNABORTED, errno_codes.ETIMEDOUT,
    errno_codes.EPIPE, errno_codes.EHOSTUNREACH, errno_codes.ENETUNREACH, errno_codes.ENETDOWN,
    errno_codes.ENETRESET, errno_codes.EAGAIN,
})
_PERMANENT = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, FileExistsError)


def _class(module: str, name: str) -> type | None:
    """A class from a module that is already imported (an exception of it cannot exist otherwise)."""
    found = getattr(sys.modules.get(module), name, None)
    return found if isinstance(found, type) else None


def instance_of(exc: BaseException, module: str, *names: str) -> bool:
    """Whether ``exc`` is an instance of one of ``module``'s classes ``names``, without importing it."""
    classes = tuple(c for c in (_class(module, n) for n in names) if c is not None)
    return bool(classes) and isinstance(exc, classes)


def _classify_builtin(exc: BaseException) -> bool | None:
    if isinstance(exc, (StepmergeError, CredentialsMissing)) or isinstance(exc, _PERMANENT):
        return False
    if isinstance(exc, (TimeoutError, ConnectionError, StorageUnavailable)):  # incl. socket/asyncio timeouts, FSTimeoutError
        return True
    return None


def _classify_http_libraries(exc: BaseException) -> bool | None:
    if instance_of(exc, "aiohttp", "ClientResponseError"):
        return getattr(exc, "status", None) in RETRY_STATUSES
    if instance_of(exc, "aiohttp", "ClientPayloadError", "ClientConnectionError", "ServerDisconnectedError"):
        return True
    if instance_of(exc, "requests.exceptions", "ConnectionError", "Timeout", "ChunkedEncodingError", "ProxyError"):
        return True
    if instance_of(exc, "http.client", "IncompleteRead"):
        return True
    if instance_of(exc, "urllib3.exceptions", "ProtocolError", "TimeoutError"):
        return True
    if isinstance(exc, OSError) and exc.errno in _NETWORK_ERRNOS:
        return True
    return None


def _classify(exc: BaseException, classifiers: Sequence[Classifier]) -> bool | None:
    """True: transient; False: permanent; None: this link of the chain does not say."""
    verdict = _classify_builtin(exc)
    if verdict is not None:
        return verdict
    for classify in classifiers:
        verdict = classify(exc)
        if verdict is not None:
            return verdict
    return _classify_http_libraries(exc)


def transient_by(exc: BaseException, classifiers: Sequence[Classifier] = ()) -> bool:
    """Whether retrying the failed storage call may succeed (``classifiers``: the clients' own rules).

    True for connection resets / refusals / drops, timeouts (incl. fsspec's ``FSTimeoutError``),
    throttling and server-side 5xx (S3 ``SlowDown`` / 503, GCS 429 / 503), aiohttp
    ``ClientPayloadError`` / ``ServerDisconnectedError``. False for ``FileNotFoundError``,
    ``PermissionError`` and every `StepmergeError`, and for anything not recognised. The chain of
    causes is followed (s3fs raises ``OSError`` *from* botocore's ``ClientError``): the first link
    that is recognised decides.
    """
    if isinstance(exc, (StepmergeError, CredentialsMissing)):
        return False
    seen: set[int] = set()
    link: BaseException | None = exc
    while link is not None and id(link) not in seen and len(seen) < 16:
        seen.add(id(link))
        verdict = _classify(link, classifiers)
        if verdict is not None:
            return verdict
        link = link.__cause__ or (None if link.__suppress_context__ else link.__context__)
    return False


def _backoff(attempt: int) -> float:
    """Exponential backoff with full jitter: uniform in [0, min(max, base * 2**attempt)]."""
    return random.uniform(0, min(tuning.BACKOFF_MAX_S, tuning.BACKOFF_BASE_S * 2**attempt))


def unavailable(exc: BaseException, what: str) -> StorageUnavailable:
    """The named error for a transient fault that outlasted the retries of ``what`` ("reading s3://...")."""
    url = next((word for word in reversed(what.split()) if "://" in word), None)
    return StorageUnavailable(f"storage unavailable while {what}, after {tuning.TRANSIENT_ATTEMPTS} attempts "
                              f"({type(exc).__name__}: {_first_line(exc)})", url)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:300] if text else ""


def retrying(call: Callable[[], _T], what: str, classify: Optional[Classifier] = None) -> _T:
    """``call()``, repeated on transient faults (`transient_by` with ``classify``, the calling
    backend's own rule) up to `tuning.TRANSIENT_ATTEMPTS` times in all.

    A transient fault still there after the last attempt is raised as `StorageUnavailable` (naming
    the URL in ``what``, the fault as its cause; still transient for the pipeline's task retries); a
    permanent one as it is."""
    classifiers = (classify,) if classify is not None else ()
    attempts = tuning.TRANSIENT_ATTEMPTS
    for attempt in range(attempts):
        try:
            return call()
        except Exception as exc:
            if not transient_by(exc, classifiers) or isinstance(exc, StorageUnavailable):
                raise
            if attempt + 1 >= attempts:
                raise unavailable(exc, what) from exc
            delay = _backoff(attempt)
            logger.warning("transient storage fault on %s (%s: %s); retry %d in %.2f s",
                           what, type(exc).__name__, exc, attempt + 1, delay)
            time.sleep(delay)
    raise AssertionError("unreachable")
