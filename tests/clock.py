"""`ManualClock`: a `merge_engine.output.clock.Clock` that moves only when the test moves it.

Code under test that takes a ``clock`` reads this one's time, and its waits block until the test has
moved the clock past their end (or their event is set). A test waits for STATES, never for time:
- `advance(seconds)` moves the clock (and wakes the waits that are due);
- `until_waiting(n)`: returns once n threads are blocked in the clock on a time still to come (e.g. "the
  heartbeat is back in its wait", "the publisher backs off"); the deadline only bounds a hang;
- ``sleeps=False``: a `sleep` fails the test at once (for code that must proceed without waiting).
"""

from __future__ import annotations

import threading
import time

from merge_engine.output.clock import Clock

HANG_S = 60.0  # bounds a hang, never a measurement
_POLL_S = 0.01  # how often a blocked wait looks at its event (an Event cannot notify a Condition)


class ManualClock(Clock):
    def __init__(self, start: float | None = None, *, sleeps: bool = True) -> None:
        self._now = time.time() if start is None else start  # near the real clock: other writers' records stay fresh
        self._sleeps = sleeps
        self._ends: list[float] = []
        self._changed = threading.Condition()
        self.slept: list[float] = []

    def time(self) -> float:
        with self._changed:
            return self._now

    def monotonic(self) -> float:
        return self.time()

    def wait(self, event: threading.Event, seconds: float) -> bool:
        with self._changed:
            end = self._now + seconds
            self._ends.append(end)
            self._changed.notify_all()
            try:
                while self._now < end and not event.is_set():
                    self._changed.wait(_POLL_S)
            finally:
                self._ends.remove(end)
                self._changed.notify_all()
        return event.is_set()

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        assert self._sleeps, f"waited {seconds:.3f} s where it must go on at once"
        self.wait(threading.Event(), seconds)

    def advance(self, seconds: float) -> None:
        with self._changed:
            self._now += seconds
            self._changed.notify_all()

    def until_waiting(self, count: int) -> None:
        with self._changed:
            assert self._changed.wait_for(lambda: sum(end > self._now for end in self._ends) >= count, HANG_S), \
                f"fewer than {count} waiting on the clock after {HANG_S:.0f} s"


def until(condition, what: str, hang_s: float = HANG_S) -> None:
    """Poll ``condition`` until it holds; fail naming ``what`` when it still does not after ``hang_s``."""
    deadline = time.monotonic() + hang_s
    while not condition():
        assert time.monotonic() < deadline, f"still not {what} after {hang_s:.0f} s"
        time.sleep(_POLL_S)
