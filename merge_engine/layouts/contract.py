"""What every on-disk checkpoint format provides: the `Layout` contract and the records it returns.

A layout is a module under ``merge_engine/layouts/`` that builds its `Layout` record (``LAYOUT``), listed
once in `merge_engine.layouts.registry.LAYOUTS`. It owns everything about its format:
file-name constants, detection, the completeness verdict from a listing, the deep check, the lazy
reader, the naming of the tensors it reads and, for formats ``stepmerge split`` writes, the writer.
A layout imports nothing of the wings above its own (`merge_engine.WINGS`), nor `discovery`, which asks the
registry. What a writer hands back (`FileRecord`) is storage's record of a written file.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from merge_engine.storage import FileEntry
from merge_engine.storage.written import FileRecord

if TYPE_CHECKING:  # `Layout.open`'s result; the contract itself imports no torch (the registry is read torch-free)
    from merge_engine.formats.tensor_source import TensorSource

# listing verdicts (`Verdict.status`)
COMPLETE, INCOMPLETE, INVALID = "complete", "incomplete", "invalid"
NOT_A_CHECKPOINT = "not_a_checkpoint"

# how the tensors of `Layout.open` are named (`Layout.tensor_naming`); the planner picks its plan by it
HF_NAMES = "hf"  # Hugging Face parameter names (FSDP state dicts, safetensors folders), maybe PEFT-wrapped
MEGATRON_NAMES = "megatron"  # canonical Megatron names (`merge_engine.architectures.megatron_names`)
# what a run records of its LoRA beside a checkpoint (verl's ``lora_train_meta.json``, PEFT's own adapter config as
# HF Trainer saves a PEFT model): a layout keeps them in `Checkpoint.files`, `merge_engine.lora.checkpoint` reads them
RUN_LORA_FILES = ("lora_train_meta.json", "adapter_config.json")


@dataclass(frozen=True)
class Verdict:
    """A completeness decision from a listing alone: a status plus the reason a person can act on.

    ``complete``; ``incomplete`` (still being written: "not yet", never an error); ``invalid`` (the
    names contradict each other, e.g. two world sizes; waiting will not fix it); ``not_a_checkpoint``
    (nothing of this format in the listing).
    """

    status: str
    reason: str = ""

    @property
    def complete(self) -> bool:
        return self.status == COMPLETE

    @property
    def present(self) -> bool:
        """The listing holds this format (complete or not)."""
        return self.status != NOT_A_CHECKPOINT


DONE = Verdict(COMPLETE)
ABSENT = Verdict(NOT_A_CHECKPOINT)


@dataclass(frozen=True)
class Checkpoint:
    """A complete checkpoint, decided from its listing and headers: what the merge needs to start.

    ``parallel`` holds the parallel sizes (``world_size`` for FSDP; ``tp``/``pp``/... for Megatron),
    ``hf_dir`` the folder with config and tokenizer, ``fingerprint`` the listing's digest, ``notes`` what
    the check found, for a person (shown, never read back by code: a fact code needs is a field).

    What the check learned, typed and carried so that nothing is read twice: ``lora`` (the weights hold LoRA
    factors: `holds_lora` of the tensor names read, or a Megatron-Bridge adapter's keys; None where the
    layout read no names), ``adapter_only`` (the weights are an adapter without its base: a fused model
    needs the base the run trained from), ``adapter_dir`` (a PEFT adapter folder saved with the weights,
    relative to ``url``; None: none) and
    ``index`` (the parsed tensor index as JSON bytes, `merge_engine.layouts.tensor_index`: `Layout.open`
    builds the source from it without reading a header again, in this process or any other it travels to,
    reading only files ``files`` lists;
    None where the layout carries none or it was over `tensor_index.MAX_INDEX_BYTES`: then `open`
    reads the headers itself). None of these takes part in equality: the listing decides what a checkpoint is.
    """

    url: str
    layout: str
    files: tuple[FileEntry, ...]
    parallel: dict[str, int] = field(default_factory=dict, hash=False)
    hf_dir: str | None = None
    fingerprint: str = ""
    notes: tuple[str, ...] = ()
    lora: bool | None = field(default=None, compare=False)
    adapter_only: bool = field(default=False, compare=False)
    adapter_dir: str | None = field(default=None, compare=False)
    index: bytes | None = field(default=None, repr=False, compare=False, hash=False)


@dataclass(frozen=True)
class StepLook:
    """Discovery's second look at a step (`Layout.second_look`): the layout it is, its verdict, and the
    merge parameters (flow parameter names) a merge needs that the step does not record."""

    layout: str
    verdict: Verdict
    needs: tuple[str, ...] = ()


@dataclass(frozen=True)
class ParallelSizes:
    """The Megatron parallel layout a writer lays tensors out in (``vpp`` None: no interleaving)."""

    tp: int = 1
    pp: int = 1
    vpp: int | None = None
    ep: int = 1


Files = list[tuple[str, int]]  # written file names (relative to the target) with their sizes


@dataclass(frozen=True)
class FileJob:
    """One file a layout's `Writer` writes whole, planned from metadata alone: ``file`` (relative to the
    target), ``part`` (the layout's coordinates of it, e.g. (pp, ep, tp) of a rank file) and the
    canonical tensors it is built from. Jobs are independent: any order, any process, same bytes."""

    file: str
    part: tuple[int, ...]
    tensors: tuple[str, ...]


@dataclass(frozen=True)
class Writer:
    """How ``stepmerge split`` writes a layout, as independent file jobs (each one work unit of the executors).

    - ``config_dir``: the folder (relative to the target) that receives config.json and tokenizer.
    - ``file_jobs(view, sizes)``: the files that hold the canonical Megatron tensors of ``view`` (a
      `merge_engine.architectures.hf_to_megatron.MegatronViewOfHf`) laid out in ``sizes``, from
      metadata alone, in a fixed order.
    - ``write_file(view, job, target_url, sizes, dtype, cancel)``: writes one of them under
      ``target_url``, cast to ``dtype`` (None: as stored), atomically (`merge_engine.storage.open_write`),
      hashing while writing; its `FileRecord`. Its bytes depend on the job alone, never on which process
      or in which order it runs. ``cancel`` (an Event) is checked between tensors: once set, the job
      raises `WriteCancelled` and leaves no file. Memory: what one file of the format holds.
    - ``finish(records, target_url)``: after every job, writes what needs all their records (a DCP
      folder's ``.metadata``, last); its records. The caller owns the target (`merge_engine.output.target`).
    """

    config_dir: str
    file_jobs: Callable[[Any, ParallelSizes], list[FileJob]]
    write_file: Callable[[Any, FileJob, str, ParallelSizes, Any, Any], FileRecord]
    finish: Callable[[Sequence[FileRecord], str], list[FileRecord]]


@dataclass(frozen=True)
class Layout:
    """One on-disk checkpoint format, as a record of its name and its functions (each layout module builds its
    own, ``LAYOUT``; `merge_engine.layouts.registry.LAYOUTS` lists them all). Contract (all paths in ``files``
    are relative to ``url``):

    - ``name``: its one name: ``--backend``, `Checkpoint.layout`, `merge_engine.layouts.discovery.Step.layout`.
    - ``tensor_naming``: `HF_NAMES` or `MEGATRON_NAMES`, the names `open` gives its tensors.
    - ``detect(files)``: does this listing hold this format (the reader to use)? Names only, no I/O.
    - ``listing_verdict(files)``: complete / incomplete / invalid / not a checkpoint, from names and
      sizes alone, no I/O: what a watcher may decide before reading a byte (discovery's verdict).
      Stricter than `check_complete` where the format writes a marker last.
    - ``check_complete(url, files)``: every required file present, non-empty and readable (headers
      only) -> `Checkpoint`; raises `IncompleteCheckpoint` / `WorldSizeMismatch` / `CorruptShard` /
      `UnsupportedLayout` naming the path at fault. Never reads a weight.
    - ``open(checkpoint)``: the lazy full-tensor `TensorSource` (headers read, bytes on demand).

    A layout with its own semantics answers through these fields (None: it has none), so that no code
    elsewhere names it:

    - ``refines``: the name of a layout whose checkpoints may turn out to be this one's once read (a LoRA
      run's dist checkpoint lists like any other); with ``refine(checkpoint, files)``: the check's
      `Checkpoint` of that layout -> this layout's, from what that check carried (no read), or None when
      it is not one (`merge_engine.layouts.check_checkpoint` asks after every check of ``refines``);
    - ``second_look(url, files)``: discovery's look at a complete step of its own or of ``refines``:
      a `StepLook` (this layout, its verdict, the merge parameters the step does not record) or None;
      a small read at most, never failing (`merge_engine.layouts.discovery`);
    - ``writer``: how ``stepmerge split`` writes it (`Writer`); None: split does not write it.

    How a layout's checkpoints are merged otherwise than by planning what `open` gives is the commands' to
    say, by layout name (`merge_engine.commands.layout_jobs`): the commands sit above.
    """

    name: str
    tensor_naming: str
    detect: Callable[[Sequence[FileEntry]], bool]
    listing_verdict: Callable[[Sequence[FileEntry]], Verdict]
    check_complete: Callable[[str, list[FileEntry]], Checkpoint]
    open: Callable[[Checkpoint], TensorSource]  # noqa: A003 - the contract's verb
    refines: str | None = None
    refine: Callable[[Checkpoint, Sequence[FileEntry]], Checkpoint | None] | None = None
    second_look: Callable[[str, Sequence[FileEntry]], StepLook | None] | None = None
    writer: Writer | None = None

    def __post_init__(self) -> None:
        if self.tensor_naming not in (HF_NAMES, MEGATRON_NAMES):
            raise ValueError(f"layout {self.name!r}: tensor_naming {self.tensor_naming!r} is not "
                             f"{HF_NAMES!r} or {MEGATRON_NAMES!r}")
        if (self.refines is None) != (self.refine is None):
            raise ValueError(f"layout {self.name!r}: refines and refine come together")


LORA_MARKERS = (".lora_A.", ".lora_embedding_A.")  # PEFT's names of a LoRA's first factor


def holds_lora(names: Iterable[str]) -> bool:
    """Do these tensor names (a PEFT-wrapped state dict's) hold LoRA factors? Names only, no I/O."""
    return any(marker in name for name in names for marker in LORA_MARKERS)


def by_path(files: Sequence[FileEntry]) -> dict[str, FileEntry]:
    return {f.path: f for f in files}
