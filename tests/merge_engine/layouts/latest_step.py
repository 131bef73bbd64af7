"""`latest_complete_step`: the highest complete step of a role, for tests (the watcher merges every complete
step not yet published, never "the latest": `flows.merge_new_steps`)."""

from __future__ import annotations

from collections.abc import Iterable

from merge_engine.layouts.discovery import Discovery, Step, discover

POLICY_ROLES = ("actor", "")  # "the model" of a run: the RL actor, or the SFT trainer's model


def latest_complete_step(source: str | Discovery | Iterable[Step], role: str | None = None) -> Step | None:
    """The highest complete step of `role` (None: the policy, i.e. ``actor`` or SFT's ``""``).

    `source` is a run root URL (listed once) or steps already discovered. None when there is none.
    """
    if isinstance(source, str):
        steps: Iterable[Step] = discover(source).steps
    elif isinstance(source, Discovery):
        steps = source.steps
    else:
        steps = source
    roles = POLICY_ROLES if role is None else (role,)
    candidates = [s for s in steps if s.complete and s.role in roles]
    return max(candidates, key=lambda s: (s.step, roles.index(s.role) * -1), default=None)
