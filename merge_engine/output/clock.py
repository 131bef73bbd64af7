"""Where lease code reads the time and waits: the system's clock, or one a test moves.

Leases (publish claims and their heartbeat, Prefect cache locks) take a ``clock`` argument that defaults to
`SYSTEM_CLOCK`; a test passes its own and moves time instead of waiting for it. A clock has:
- `time()`: the wall clock, written into heartbeats and compared with other writers' heartbeats;
- `monotonic()`: for deadlines and for the age of our own last heartbeat;
- `wait(event, seconds)`: wait until ``event`` is set or ``seconds`` have passed; True when it was set;
- `sleep(seconds)`.
"""

from __future__ import annotations

import threading
import time

__all__ = ["Clock", "SYSTEM_CLOCK"]


class Clock:
    """The system clock (see the module docstring); a test subclasses it to move time itself."""

    def time(self) -> float:
        return time.time()

    def monotonic(self) -> float:
        return time.monotonic()

    def wait(self, event: threading.Event, seconds: float) -> bool:
        return event.wait(seconds)

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)


SYSTEM_CLOCK = Clock()
