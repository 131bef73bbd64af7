"""Run root -> the checkpoint steps in it, classified from ONE recursive listing.

Contract:
- `discover(run_root_url)` lists the run root once (`storage.list_files`, recursive) and reads no
  weight byte; the only read is the tracker file, and only when the listing shows one.
- Step folders are ``global_step_<N>/`` (verl) or ``iter_<N>/`` (Megatron-LM). Inside a step,
  ``actor/`` and ``critic/`` are roles (verl RL); weights straight in the step folder are role ``""``
  (verl SFT trainers, Megatron-LM).
- A (step, role) is a checkpoint when its files match a layout signature (`SIGNATURES`). A step holding
  only ``data.pt`` (verl retention deletes ``actor/`` and keeps ``data.pt``) or nothing at all is not one.
- Each checkpoint gets a status from its primary layout's completeness rule, decided from names and
  sizes alone: ``"complete"``, ``"incomplete"`` (still being written: "not yet", never an error) or
  ``"invalid"`` (the names contradict each other, e.g. two world sizes; waiting will not fix it).
- ``latest_checkpointed_iteration.txt`` is a hint only (verl writes it in place, non-atomically, and not
  at all under async save): it is returned beside the steps and never decides which steps exist.

The watcher's FSDP rule (`fsdp_listing_verdict`) is stricter than a hand merge's
(`merge_engine.layouts.fsdp`): it also waits for ``fsdp_config.json`` and for every rank's optimizer and
extra-state files, the last things verl writes, so that a step is merged once, when it is whole. The
layout's own check (every rank file present and a readable archive) still runs before any merge.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from functools import partial

from merge_engine import storage
from merge_engine.storage import FileEntry

TRACKER_FILE = "latest_checkpointed_iteration.txt"
ROLES = ("actor", "critic")  # verl RL role folders; anything else in a step folder belongs to role ""
COMPLETE, INCOMPLETE, INVALID = "complete", "incomplete", "invalid"

_STEP_DIR = re.compile(r"^(?:global_step_(\d+)|iter_(\d+))$")


# --------------------------------------------------------------------------------------------------
# Completeness verdicts


@dataclass(frozen=True)
class Verdict:
    """A completeness decision from a listing: status plus the reason a person can act on."""

    status: str
    reason: str = ""

    @property
    def complete(self) -> bool:
        return self.status == COMPLETE


_DONE = Verdict(COMPLETE)


def _by_path(files: Iterable[FileEntry]) -> dict[str, FileEntry]:
    return {f.path: f for f in files}


# --------------------------------------------------------------------------------------------------
# FSDP (verl): model/optim/extra_state_world_size_{W}_rank_{R}.pt + fsdp_config.json

_FSDP_RANK_FILE = re.compile(r"^(model|optim|extra_state)_world_size_(\d+)_rank_(\d+)\.pt$")
FSDP_CONFIG = "fsdp_config.json"


def fsdp_listing_verdict(files: Iterable[FileEntry], config_world_size: int | None = None) -> Verdict:
    """Is a verl FSDP folder complete, judging by its listing alone (paths relative to the folder)?

    Complete when: every ``model_world_size_W_rank_R.pt`` for R in 0..W-1 is present and non-empty,
    all rank files name one world size W (and it equals ``config_world_size`` when the caller read
    ``fsdp_config.json``), ``fsdp_config.json`` is present, and each other per-rank kind that exists
    (optim, extra_state) exists for every rank and is non-empty. Why the last rule: each rank writes
    model, then optim, then extra_state, and rank 0 writes ``fsdp_config.json`` BEFORE the final
    barrier, so the config alone does not prove the other ranks are done; a rank's later file does.
    This cannot see a file that is non-empty but still growing on a local disk: the layout's deep
    check (zip readable) covers that.
    """
    kinds: dict[str, dict[int, FileEntry]] = defaultdict(dict)
    world_sizes: dict[str, set[int]] = defaultdict(set)
    has_config = False
    for entry in files:
        if entry.path == FSDP_CONFIG:
            has_config = True
            continue
        match = _FSDP_RANK_FILE.match(entry.path)
        if match:
            kind, world, rank = match.group(1), int(match.group(2)), int(match.group(3))
            world_sizes[kind].add(world)
            kinds[kind][rank] = entry
    all_sizes = set().union(*world_sizes.values()) if world_sizes else set()
    if len(all_sizes) > 1:
        return Verdict(INVALID, f"rank files name several world sizes {sorted(all_sizes)}")
    if not kinds.get("model"):
        return Verdict(INCOMPLETE, "no model_world_size_*_rank_*.pt file yet")
    (world,) = all_sizes
    if config_world_size is not None and config_world_size != world:
        return Verdict(INVALID, f"file names say world size {world}, {FSDP_CONFIG} says {config_world_size}")
    for kind in ("model", "optim", "extra_state"):
        ranks = kinds.get(kind)
        if not ranks:
            continue
        beyond = sorted(r for r in ranks if r >= world)
        if beyond:
            return Verdict(INVALID, f"{kind} rank files {beyond} are beyond world size {world}")
        missing = sorted(set(range(world)) - set(ranks))
        if missing:
            return Verdict(INCOMPLETE, f"{kind} files for ranks {missing} of {world} not written yet")
        empty = sorted(r for r, e in ranks.items() if e.size == 0)
        if empty:
            return Verdict(INCOMPLETE, f"{kind} files for ranks {empty} are empty (still being written)")
    if not has_config:
        return Verdict(INCOMPLETE, f"{FSDP_CONFIG} not written yet")
    return _DONE


# --------------------------------------------------------------------------------------------------
# Megatron


V2_MARKER = "ckpt_contents.json"  # verl >= 0.9 Megatron: rank 0 writes it LAST, atomically
# group 1: tensor-parallel rank; group 2: "_PPP", "_EEE" or "_PPP_EEE" (absent when that size is 1)
MEGATRON_LEGACY_FILE = re.compile(r"^model/mp_rank_(\d{2})((?:_\d{3}){0,2})/model\.pt$")
MEGATRON_LM_FILE = re.compile(r"^(?:iter_\d+/)?mp_rank_(\d{2})((?:_\d{3}){0,2})/[^/]+\.pt$")


def _v2_marker_verdict(files: Sequence[FileEntry]) -> Verdict:
    if any(f.path == V2_MARKER for f in files):
        return _DONE
    return Verdict(INCOMPLETE, f"{V2_MARKER} (written last) not present yet")


def megatron_dist_verdict(files: Sequence[FileEntry]) -> Verdict:
    """verl v2 ``model/dist_ckpt/``: the ``ckpt_contents.json`` marker. verl v1 ``dist_ckpt/`` and
    Megatron-LM ``torch_dist`` iterations: ``.metadata`` (written by the DCP coordinator after every
    rank's data) and ``metadata.json`` (megatron-core writes it after that) both present."""
    paths = _by_path(files)
    if any(p.startswith("model/dist_ckpt/") for p in paths):
        return _v2_marker_verdict(files)
    folder = "dist_ckpt/" if any(p.startswith("dist_ckpt/") for p in paths) else ""
    missing = [name for name in (".metadata", "metadata.json") if folder + name not in paths]
    if missing:
        return Verdict(INCOMPLETE, f"{folder or './'} lacks {', '.join(missing)} (written last)")
    return _DONE


def megatron_rank_grid_verdict(files: Sequence[FileEntry], pattern: re.Pattern[str]) -> Verdict:
    """Per-rank ``mp_rank_TT[_PPP][_EEE]/*.pt`` folders (paths matching `pattern`): every cell of
    the (tp, pp, ep) grid the names span is present and non-empty. The highest ranks of a grid still
    being written are invisible from names alone; the Megatron layout checks the parallel sizes it
    reads from the checkpoint."""
    cells: dict[tuple[int, ...], list[FileEntry]] = defaultdict(list)
    for entry in files:
        match = pattern.match(entry.path)
        if match:
            coords = (int(match.group(1)),) + tuple(int(x) for x in match.group(2).split("_") if x)
            cells[coords].append(entry)
    if not cells:
        return Verdict(INCOMPLETE, "no mp_rank_* file yet")
    dims = {len(c) for c in cells}
    if len(dims) > 1:
        return Verdict(INVALID, "mp_rank_* folder names mix parallel dimensions")
    ndim = dims.pop()
    spans = [max(c[i] for c in cells) + 1 for i in range(ndim)]
    grid: list[tuple[int, ...]] = [()]
    for span in spans:
        grid = [g + (i,) for g in grid for i in range(span)]
    missing = [g for g in grid if g not in cells]
    if missing:
        return Verdict(INCOMPLETE, f"{len(missing)} mp_rank folders of {len(grid)} not written yet")
    empty = sorted(e.path for es in cells.values() for e in es if e.size == 0)
    if empty:
        return Verdict(INCOMPLETE, f"empty (still being written): {empty[:3]}")
    return _DONE


# --------------------------------------------------------------------------------------------------
# Hugging Face weights saved beside a training checkpoint


def hf_weights_verdict(files: Sequence[FileEntry]) -> Verdict:
    """``model/huggingface/`` (verl v2): the ``ckpt_contents.json`` marker. ``huggingface/``:
    ``model.safetensors.index.json`` present (transformers writes it after every shard), or a single
    non-empty ``model.safetensors``."""
    paths = _by_path(files)
    if any(p.startswith("model/huggingface/") for p in paths):
        return _v2_marker_verdict(files)
    if "huggingface/model.safetensors.index.json" in paths:
        return _DONE
    single = paths.get("huggingface/model.safetensors")
    if single is not None and single.size > 0:
        return _DONE
    return Verdict(INCOMPLETE, "huggingface/ shards present but model.safetensors.index.json not written yet")


# --------------------------------------------------------------------------------------------------
# The table: which files prove a layout, and how its completeness is decided


@dataclass(frozen=True)
class LayoutSignature:
    """A layout is present when any file (path relative to the weights folder) matches `proof`."""

    name: str  # the module under merge_engine/layouts that reads it
    proof: re.Pattern[str]
    verdict: Callable[[Sequence[FileEntry]], Verdict]


# Priority order: the first layout present is the step's primary layout (the one a merge reads).
SIGNATURES: tuple[LayoutSignature, ...] = (
    LayoutSignature(
        "fsdp",
        re.compile(r"^(?:(?:model|optim|extra_state)_world_size_\d+_rank_\d+\.pt|fsdp_config\.json)$"),
        fsdp_listing_verdict,
    ),
    LayoutSignature(
        "megatron_dist",
        re.compile(r"^(?:(?:model/)?dist_ckpt/.+|[^/]+\.distcp)$"),
        megatron_dist_verdict,
    ),
    LayoutSignature(
        "megatron_legacy",
        MEGATRON_LEGACY_FILE,
        partial(megatron_rank_grid_verdict, pattern=MEGATRON_LEGACY_FILE),
    ),
    LayoutSignature(
        "megatron_lm",  # Megatron-LM's own per-rank files (same pickle format as megatron_legacy)
        MEGATRON_LM_FILE,
        partial(megatron_rank_grid_verdict, pattern=MEGATRON_LM_FILE),
    ),
    LayoutSignature(
        "hf",
        re.compile(r"^(?:model/)?huggingface/[^/]+\.safetensors$"),
        hf_weights_verdict,
    ),
)


def detect_layouts(files: Sequence[FileEntry]) -> tuple[str, ...]:
    """Names of the layouts whose signature matches these files, in priority order."""
    return tuple(sig.name for sig in SIGNATURES if any(sig.proof.match(f.path) for f in files))


def classify(files: Sequence[FileEntry]) -> tuple[tuple[str, ...], Verdict]:
    """Layouts present and the primary layout's verdict; ``((), ...)`` when it is no checkpoint."""
    layouts = detect_layouts(files)
    if not layouts:
        return (), Verdict(INCOMPLETE, "no checkpoint files")
    primary = next(sig for sig in SIGNATURES if sig.name == layouts[0])
    return layouts, primary.verdict(files)


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
        match = _STEP_DIR.match(parts[0])
        if not match:
            continue
        number = int(match.group(1) or match.group(2))
        if len(parts) > 2 and parts[1] in ROLES:
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


def parse_tracker(text: str) -> int | None:
    """The step number in a tracker file, or None when it is empty, partial or not a number."""
    text = text.strip()
    return int(text) if text.isdigit() else None


def read_tracker_hint(run_root_url: str) -> int | None:
    """The number in ``latest_checkpointed_iteration.txt``; None when absent or unreadable."""
    try:
        return parse_tracker(storage.read_text(storage.join(run_root_url, TRACKER_FILE)))
    except (FileNotFoundError, UnicodeDecodeError):
        return None


def discover(run_root_url: str) -> Discovery:
    """Steps of a run root from one recursive listing, plus the tracker hint (read only if listed)."""
    entries = storage.list_files(run_root_url, recursive=True)
    hint = None
    if any(e.path == TRACKER_FILE for e in entries):
        hint = read_tracker_hint(run_root_url)
    return Discovery(run_root_url, tuple(steps_from_listing(run_root_url, entries)), hint)


def discover_steps(run_root_url: str) -> list[Step]:
    """Every checkpoint under a run root, complete or not, sorted by (step, role). See `discover`."""
    return list(discover(run_root_url).steps)


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
