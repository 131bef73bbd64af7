"""Interrupts (SIGINT, SIGTERM) that stop a command cleanly: every shard job stops, the uploads in flight
are aborted (or completed, then deleted), the target is cleaned up, and only then does the command end.

- `handling_signals()`: the command line runs each command inside it. SIGINT and SIGTERM both become
  `Interrupted` (a `KeyboardInterrupt` that carries the signal: exit code 128 + its number, 130 / 143).
  Outside a `deferred` section it is raised at once in the main thread: nothing is being written
  (listing, checking, planning). Inside one, the signal only sets the process-wide request
  (`requested`): shard jobs stop at their next chunk (their ``cancel`` event is a `cancel_event`,
  which reads as set once an interrupt is requested), executors stop the other jobs and wait until
  every one has stopped, the section's cleanup runs whole, and `Interrupted` is raised as the section
  ends. Signals after the first are ignored: the cleanup is never cut short, and nothing is written
  once `Interrupted` has left the section.
- `deferred()`: the section around a target's write and its cleanup (`merge_engine.output.target`).
- `check()`: raise `Interrupted` if an interrupt was requested (at the points a section may stop).

Without `handling_signals` (a library caller, a Prefect task) Python's own SIGINT handling stays: a
`KeyboardInterrupt` can arrive anywhere, and the executors still stop and wait for every job before
it propagates.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

__all__ = ["Interrupted", "cancel_event", "check", "deferred", "handling_signals", "reclaim_signals", "requested"]

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(KeyboardInterrupt):
    """The command was interrupted by ``signum`` (SIGINT or SIGTERM); ``exit_code`` is 128 + signum."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class _State:
    signum: int | None = None
    depth = 0  # deferred sections the main thread is in
    handling = False


_STATE = _State()
_REQUESTED = threading.Event()


def requested() -> bool:
    """Whether an interrupt was requested (and not yet handled by the end of `handling_signals`)."""
    return _REQUESTED.is_set()


def check() -> None:
    """Raise `Interrupted` if an interrupt was requested."""
    if _REQUESTED.is_set():
        raise Interrupted(_STATE.signum or signal.SIGINT)


class _CancelEvent(threading.Event):
    """A job's cancel event: set by the job's executor, and read as set once an interrupt is requested."""

    def is_set(self) -> bool:
        return super().is_set() or _REQUESTED.is_set()


def cancel_event() -> threading.Event:
    """A fresh cancel event for a set of jobs (see `_CancelEvent`)."""
    return _CancelEvent()


def _on_signal(signum: int, frame: object) -> None:
    if _STATE.signum is not None:
        return  # already stopping: the cleanup runs to its end
    _STATE.signum = signum
    _REQUESTED.set()
    if _STATE.depth == 0:
        raise Interrupted(signum)


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


@contextlib.contextmanager
def handling_signals() -> Iterator[None]:
    """SIGINT and SIGTERM as `Interrupted` while the block runs (see the module docstring); the previous
    handlers are restored after, unless the block was interrupted: then both signals stay ignored, so
    that more of them cannot cut short the exit of a process that has cleaned up (an in-process caller
    that goes on sets its own handlers again). Outside the main thread (where Python cannot take
    signals) it does nothing."""
    if not _in_main_thread() or _STATE.handling:
        yield
        return
    previous = {signum: signal.getsignal(signum) for signum in SIGNALS}
    _STATE.signum, _STATE.depth, _STATE.handling = None, 0, True
    _REQUESTED.clear()
    for signum in SIGNALS:
        signal.signal(signum, _on_signal)
    try:
        yield
    finally:
        interrupted = _STATE.signum is not None
        for signum, handler in previous.items():  # interrupted: the process is ending, let nothing cut it short
            signal.signal(signum, signal.SIG_IGN if interrupted else handler)
        _STATE.signum, _STATE.depth, _STATE.handling = None, 0, False
        _REQUESTED.clear()


def reclaim_signals() -> None:
    """Take SIGINT and SIGTERM back inside `handling_signals`, after a library installed its own handlers
    (Ray's driver, once connected, aborts the process on SIGTERM, leaving every task's upload behind)."""
    if _STATE.handling and _in_main_thread():
        for signum in SIGNALS:
            signal.signal(signum, _on_signal)


class deferred:
    """A section whose work stops at its own checks on an interrupt, and whose cleanup runs whole; an
    interrupt requested during it is raised (`Interrupted`) when it ends, whatever else ended it."""

    def __enter__(self) -> deferred:
        if _in_main_thread():
            _STATE.depth += 1
        return self

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        if _in_main_thread():
            _STATE.depth -= 1
        if _REQUESTED.is_set() and not isinstance(exc, Interrupted):
            raise Interrupted(_STATE.signum or signal.SIGINT) from exc
