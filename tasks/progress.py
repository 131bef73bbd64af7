"""A Prefect progress artifact that moves while a merge writes (the engine's on_plan / on_bytes hooks).

`ProgressArtifact.on_plan(plan)` creates the artifact (0 %), `on_bytes(n)` adds written bytes and
updates it at most every ``min_interval_s`` (and at 100 %), `finish()` sets 100 %. Outside a Prefect
run, or when the API refuses an update, it only counts: progress never fails a merge. Updates are
made from the thread that created the artifact only (Prefect's client settings live in context
variables, which other threads do not see).
"""

from __future__ import annotations

import logging
import re
import threading
import time
from typing import Any, Optional
from uuid import UUID

logger = logging.getLogger(__name__)


def artifact_key(*parts: object) -> str:
    """A Prefect artifact key (lowercase letters, digits, dashes) from free-form parts."""
    text = "-".join(str(p) for p in parts if str(p))
    return re.sub(r"-{2,}", "-", re.sub(r"[^a-z0-9-]+", "-", text.lower())).strip("-")[:120] or "stepmerge"


def release_artifact_key(prefix: str, release_url: str) -> str:
    """``<prefix>-<folder>-<step>-<hash>``: one artifact collection per release URL."""
    import hashlib

    tail = release_url.rstrip("/").rsplit("/", 2)[-2:]
    return artifact_key(prefix, *tail, hashlib.sha256(release_url.encode()).hexdigest()[:8])


class ProgressArtifact:
    """See the module docstring."""

    def __init__(self, key: str, description: str, min_interval_s: float = 1.0) -> None:
        self.key = key
        self.description = description
        self.min_interval_s = min_interval_s
        self.total = 0
        self.done = 0
        self.updates = 0
        self.artifact_id: Optional[UUID] = None
        self._last = 0.0
        self._thread = threading.get_ident()

    @staticmethod
    def _in_run() -> bool:
        from prefect.context import FlowRunContext, TaskRunContext

        return TaskRunContext.get() is not None or FlowRunContext.get() is not None

    def on_plan(self, plan: Any) -> None:
        self.total = int(getattr(plan, "total_size", 0) or 0)
        if not self._in_run():
            return
        try:
            from prefect.artifacts import create_progress_artifact

            created = create_progress_artifact(0.0, key=self.key, description=self.description)
            if isinstance(created, UUID):  # a sync caller's id (an async one would get a coroutine: none here)
                self.artifact_id = created
            self._last = time.monotonic()
        except Exception as exc:  # noqa: BLE001 - progress is best effort
            logger.warning("could not create the progress artifact %s: %s", self.key, exc)

    def on_bytes(self, count: int) -> None:
        self.done += int(count)
        now = time.monotonic()
        if (now - self._last >= self.min_interval_s) or (self.total and self.done >= self.total):
            self._update(self.percent)

    @property
    def percent(self) -> float:
        return 100.0 if not self.total else min(100.0, 100.0 * self.done / self.total)

    def finish(self) -> None:
        self._update(100.0)

    def _update(self, percent: float) -> None:
        self._last = time.monotonic()
        if self.artifact_id is None or threading.get_ident() != self._thread:
            return
        try:
            from prefect.artifacts import update_progress_artifact

            update_progress_artifact(self.artifact_id, percent)
            self.updates += 1
        except Exception as exc:  # noqa: BLE001
            logger.warning("could not update the progress artifact %s: %s", self.key, exc)
