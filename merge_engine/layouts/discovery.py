"""Run root -> the checkpoint steps in it, classified from ONE recursive listing.

Contract:
- `discover(run_root_url)` lists the run root once (`storage.list_files`, recursive) and reads no
  weight byte; the only reads are the tracker file, when the listing shows one, and the small file a
  layout with a second look reads of a complete step (`Layout.second_look`: verl's ``ckpt_contents.json``
  says a step whose names look like a plain dist checkpoint is a LoRA step); `Step.needs` says which merge
  parameters such a step does not record.
- Step folders are the ones a run layout names (`merge_engine.layouts.runs`: verl's ``global_step_<N>/``,
  Megatron-LM's ``iter_<N>/``). Inside a step, the run layout's role folders are roles (verl RL:
  ``actor/`` and ``critic/``); weights straight in the step folder are role ``""`` (verl SFT trainers,
  Megatron-LM).
- A (step, role) is a checkpoint when some layout of the registry (`merge_engine.layouts.registry.LAYOUTS`)
  finds its files in the listing (`Layout.listing_verdict`). A step holding only ``data.pt`` (verl
  retention deletes ``actor/`` and keeps ``data.pt``) or nothing at all is not one.
- Each checkpoint's status is its primary layout's verdict (the first present, in registry order),
  decided from names and sizes alone: ``"complete"``, ``"incomplete"`` (still being written: "not
  yet", never an error) or ``"invalid"`` (the names contradict each other; waiting will not fix it).
  Discovery keeps no rule of its own: each format's rule lives in its layout module.
- `discover_step` classifies one (step, role) the same way from a listing of its step folder alone.
- ``latest_checkpointed_iteration.txt`` is a hint only (verl writes it in place, non-atomically, and not
  at all under async save): it is returned beside the steps and never decides which steps exist.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace

from merge_engine import storage
from merge_engine.errors import RunRootNotFound
from merge_engine.layouts import LAYOUTS, listing_verdicts, runs
from merge_engine.layouts.contract import COMPLETE, INCOMPLETE, INVALID, Verdict
from merge_engine.layouts.tracker import TRACKER_FILE, parse_tracker, read_tracker_hint
from merge_engine.storage import FileEntry

__all__ = ["COMPLETE", "INCOMPLETE", "INVALID", "TRACKER_FILE", "Discovery",
           "Step", "Verdict", "classify", "discover", "discover_step", "discover_steps",
           "parse_tracker", "read_tracker_hint", "steps_from_listing"]



def classify(files: Sequence[FileEntry]) -> tuple[tuple[str, ...], Verdict]:
    """Layouts present (registry order) and the primary layout's verdict; ``((), ...)`` when it is no
    checkpoint."""
    found = listing_verdicts(files)
    if not found:
        return (), Verdict(INCOMPLETE, "no checkpoint files")
    return tuple(name for name, _ in found), found[0][1]


# --------------------------------------------------------------------------------------------------
# Steps


@dataclass(frozen=True)
class Step:
    """One checkpoint: a (step, role) of a run, where its weights are, and whether it is complete.

    `url` is the folder holding the weights (``.../global_step_N/actor`` or ``.../global_step_N``);
    `files` is its listing (paths relative to `url`), so a layout need not list it again;
    `fingerprint` is `storage.fingerprint(files)` (names, sizes, versions; no options).
    """

    run_root: str
    step: int
    role: str
    url: str
    status: str
    layout: str
    reason: str = ""
    layouts: tuple[str, ...] = ()
    fingerprint: str = ""
    needs: tuple[str, ...] = ()  # merge parameters the step does not record (a Megatron LoRA step's)
    files: tuple[FileEntry, ...] = field(default=(), repr=False, compare=False)

    @property
    def complete(self) -> bool:
        return self.status == COMPLETE

    @property
    def key(self) -> str:
        """``{run_root}:{role}:{step}``: the idempotency key of one merge of this checkpoint."""
        return f"{self.run_root}:{self.role}:{self.step}"


@dataclass(frozen=True)
class Discovery:
    """The steps of a run root plus the tracker file's number (a hint, possibly stale or absent)."""

    run_root: str
    steps: tuple[Step, ...]
    tracker_hint: int | None = None


def _group_by_checkpoint(entries: Iterable[FileEntry]) -> dict[tuple[int, str, str], list[FileEntry]]:
    """(step, role, folder relative to the run root) -> files relative to that folder."""
    groups: dict[tuple[int, str, str], list[FileEntry]] = defaultdict(list)
    for entry in entries:
        parts = entry.path.split("/")
        if len(parts) < 2:
            continue
        run_layout = runs.run_layout_of(parts[0])
        if run_layout is None:
            continue
        number = run_layout.step_of(parts[0])
        if number is None:  # never: the run layout was found by this name
            continue
        if len(parts) > 2 and parts[1] in run_layout.roles:
            role, folder, rest = parts[1], f"{parts[0]}/{parts[1]}", parts[2:]
        else:
            role, folder, rest = "", parts[0], parts[1:]
        groups[(number, role, folder)].append(FileEntry("/".join(rest), entry.size, entry.version))
    return groups


def steps_from_listing(run_root_url: str, entries: Iterable[FileEntry]) -> list[Step]:
    """Classify a run root's recursive listing (paths relative to the root) into steps.

    Pure: no I/O. Sorted by (step, role). Groups without a layout (pruned steps) are dropped.
    """
    steps = []
    for (number, role, folder), files in _group_by_checkpoint(entries).items():
        layouts, verdict = classify(files)
        if not layouts:
            continue
        steps.append(
            Step(
                run_root=run_root_url,
                step=number,
                role=role,
                url=storage.join(run_root_url, *folder.split("/")),
                status=verdict.status,
                layout=layouts[0],
                reason=verdict.reason,
                layouts=layouts,
                fingerprint=storage.fingerprint(files),
                files=tuple(sorted(files, key=lambda f: f.path)),
            )
        )
    return sorted(steps, key=lambda s: (s.step, s.role))


def second_looks(steps: Iterable[Step], look_at: Callable[[Step], bool] | None = None) -> list[Step]:
    """``steps`` with each complete one (that ``look_at`` chooses, when given) looked at again by the layouts that
    read one small file to say what a step is (`Layout.second_look`, asked for steps of their own layout or of
    the one they refine): a step one of them claims takes its layout, verdict and `Step.needs`; the others are
    unchanged."""
    lookers = [(layout, layout.second_look) for layout in LAYOUTS if layout.second_look is not None]
    out = []
    for step in steps:
        for layout, second_look in lookers if step.complete and (look_at is None or look_at(step)) else ():
            if step.layout not in (layout.name, layout.refines):
                continue
            look = second_look(step.url, step.files)
            if look is not None:
                layouts = (look.layout, *(n for n in step.layouts if n != look.layout))
                step = replace(step, status=look.verdict.status, reason=look.verdict.reason, layout=look.layout,
                               layouts=layouts, needs=look.needs)
                break
        out.append(step)
    return out


def discover(run_root_url: str, look_at: Callable[[Step], bool] | None = None) -> Discovery:
    """Steps of a run root from one recursive listing, plus the tracker hint (read only if listed). The second
    look (`second_looks`) is given the complete steps ``look_at`` chooses (None: all); a caller that will act on
    some steps only (the watcher: steps not yet released) spares the others' reads.

    Raises `RunRootNotFound` when the run root holds no file at all (missing, or a typo): an empty
    answer would look like "nothing to do" to everyone who asks.
    """
    entries = storage.list_files(run_root_url, recursive=True)
    if not entries:
        raise RunRootNotFound("no files under this run root: it does not exist (a typo?) or nothing was "
                              "written there yet", run_root_url)
    hint = None
    if any(e.path == TRACKER_FILE for e in entries):
        hint = read_tracker_hint(run_root_url)
    return Discovery(run_root_url, tuple(second_looks(steps_from_listing(run_root_url, entries), look_at)), hint)


def discover_step(run_root_url: str, step: int, role: str, look_again: bool = True) -> Step | None:
    """One (step, role) of a run, as `discover` would classify it, from a listing of that step's folder
    only (the first of `runs.step_folders` that holds files: ``global_step_<N>/``, else ``iter_<NNNNNNN>/``),
    never of the whole run root. None when the step folder holds no checkpoint of ``role``. Without
    ``look_again``, from the listing alone (no `second_looks`): for a caller that checks the step next, whose
    check reads what a second look would (a step's marker is then read once)."""
    for folder in runs.step_folders(step):
        entries = storage.list_files(storage.join(run_root_url, folder), recursive=True)
        if entries:
            inside = (FileEntry(f"{folder}/{e.path}", e.size, e.version) for e in entries)
            found = [s for s in steps_from_listing(run_root_url, inside) if s.role == role]
            return next(iter(second_looks(found) if look_again else found), None)
    return None


def discover_steps(run_root_url: str) -> list[Step]:
    """Every checkpoint under a run root, complete or not, sorted by (step, role). See `discover`."""
    return list(discover(run_root_url).steps)


