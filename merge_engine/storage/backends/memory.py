"""fsspec's in-process store (``memory://``): a real fsspec client, for tests and scratch work.

Not shared: another process sees none of it, so URLs crossing a process (flow parameters,
webhooks) may not use it.
"""

from __future__ import annotations

from merge_engine.storage.backend import FsspecBackend


class MemoryBackend(FsspecBackend):
    schemes = ("memory",)
    shared = False


BACKEND = MemoryBackend()
