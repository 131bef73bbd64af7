"""On-disk checkpoint formats, each a module that builds its `merge_engine.layouts.contract.Layout` record
(``LAYOUT``), all listed once in `merge_engine.layouts.registry.LAYOUTS` (in priority order: the first that detects a
listing reads it).

- ``fsdp``: verl FSDP rank files;
- ``megatron_legacy``: Megatron per-rank ``mp_rank_*`` files (verl's ``model.pt``, Megatron-LM's
  ``model_optim_rng.pt``); written by ``stepmerge split --format legacy``;
- ``megatron_lora``: verl Megatron LoRA steps (Megatron-Bridge PEFT): the adapter in ``model/dist_ckpt``
  (+ the PEFT folder ``model/huggingface/adapter``), the base there too only with
  ``use_dist_checkpointing``; before ``megatron_bridge`` and ``megatron_dist``;
- ``megatron_bridge``: Hugging Face weights a Megatron run saved through a bridge (before
  ``megatron_dist``: when both are there, the Hugging Face weights are read);
- ``torch_dcp`` (`dcp_model`): a model's state dict saved by ``torch.distributed.checkpoint`` (Accelerate / HF
  Trainer / TRL FSDP ``pytorch_model_fsdp_0/``, NeMo-RL policy weights, plain ``dcp.save``); before
  ``megatron_dist``, which it leaves every folder with Megatron's ``common.pt`` / ``metadata.json``;
- ``torchtitan``: a ``torch_dcp`` checkpoint in torchtitan's own names (it refines ``torch_dcp``'s check; its jobs
  rename them by the family table of `merge_engine.architectures.torchtitan`);
- ``megatron_dist``: Megatron ``torch_dist`` checkpoints; written by ``split --format dist``;
- ``dcp_hf``: a state dict saved through torch's ``HuggingFaceStorageWriter``, one safetensors file per rank and
  output file (``shard-0000R-model-0000K-of-0000M.safetensors``); before ``hf``, which would take the folder
  for a Hugging Face folder missing its index;
- ``deepspeed_zero``: DeepSpeed ZeRO stage 1/2/3 tag folders (``global_stepN/``, also inside HF Trainer's
  ``checkpoint-N/``), rebuilt from the fp32 master partitions; before ``hf``, which HF Trainer's folder also is;
- ``hf``: Hugging Face folders (``config.json`` + safetensors), also as saved beside a step.

Run layouts, one per trainer, listed once in `runs.RUN_LAYOUTS`: how a run root names its step folders
(verl's ``global_step_<N>/``, Megatron-LM's ``iter_<NNNNNNN>/``); discovery and the release layout ask it.

Helpers with no format of their own: `contract` (the `Layout` record and the records it returns), `registry`
(the list of layouts), `megatron_lm_root` (a Megatron-LM run root -> one iteration), `tracker`
(``latest_checkpointed_iteration.txt``), `verl_v2` (verl's ``ckpt_contents.json`` marker).

Entry points: `layout_named`, `find_layout`, `listing_verdicts` (discovery), `check_checkpoint`,
`open_checkpoint`, `open_hf_folder`. Adding a format is one module plus one line in `registry.LAYOUTS`; a format
with its own semantics answers through its record's optional fields (``refines``/``refine``, ``second_look``,
``writer``); how the commands merge it otherwise is theirs to say (`merge_engine.commands.layout_jobs`).

Importing the registry imports no torch (nor transformers): a layout module holds its names,
detection and listing verdict at module level and imports its readers (torch archives, safetensors,
DCP, family tables) inside `check_complete` / `open` / `write`, so discovery and a listings-only
watcher run without them (``tests/merge_engine/layouts/test_registry_imports.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from merge_engine import storage
from merge_engine.errors import IncompleteCheckpoint, SourceChanged, UnsupportedLayout
from merge_engine.layouts import hf
from merge_engine.layouts.contract import (
    HF_NAMES,
    MEGATRON_NAMES,
    Checkpoint,
    Layout,
    Verdict,
    Writer,
)
from merge_engine.layouts.registry import ALIASES, BY_NAME, LAYOUTS
from merge_engine.storage.source_files import check_local_tree
from merge_engine.storage import FileEntry

if TYPE_CHECKING:
    from merge_engine.formats.tensor_source import TensorSource

__all__ = ["ALIASES", "BY_NAME", "HF_NAMES", "LAYOUTS", "MEGATRON_NAMES", "Checkpoint", "Layout", "Verdict",
           "Writer", "check_checkpoint", "check_unchanged", "find_layout", "layout_named",
           "listing_verdicts", "open_checkpoint", "open_hf_folder", "refined"]


def layout_named(name: str) -> Layout:
    """The layout called ``name``; `UnsupportedLayout` listing the known names otherwise."""
    if name not in BY_NAME:
        known = ", ".join([*BY_NAME, *ALIASES])
        raise UnsupportedLayout(f"unknown backend {name!r}; known: {known}")
    return BY_NAME[name]


def find_layout(url: str, files: list[FileEntry], backend: str | None = None) -> Layout:
    """The first layout (among ``backend``'s, a layout name or an alias; default all) that detects
    ``files``; `IncompleteCheckpoint` for an empty listing, `UnsupportedLayout` when none does."""
    if backend:
        candidates = [layout_named(n) for n in ALIASES.get(backend, (backend,))]
    else:
        candidates = list(LAYOUTS)
    found = next((layout for layout in candidates if layout.detect(files)), None)
    if found is not None:
        return found
    if not files:
        raise IncompleteCheckpoint("no files found (missing or empty folder)", url)
    deeper = checkpoint_below(url, files, candidates)
    hint = f" (did you mean {deeper}?)" if deeper else ""
    if backend:
        raise UnsupportedLayout(f"this folder is not a {backend} checkpoint{hint}", url)
    raise UnsupportedLayout(
        f"no known checkpoint layout in this folder ({len(files)} files, e.g. {files[0].path}){hint}; "
        f"known layouts: {', '.join(BY_NAME)}", url)


def checkpoint_below(url: str, files: Sequence[FileEntry], candidates: Sequence[Layout]) -> str | None:
    """The URL of the first folder one or two levels below ``url`` that one of ``candidates`` detects
    (a step folder given for its ``actor/``, a run root for ``global_step_N/actor``), from the same
    listing (nothing more is read); None when there is none."""
    folders: dict[str, list[FileEntry]] = {}
    for entry in files:
        parts = entry.path.split("/")
        for depth in (1, 2):
            if len(parts) > depth:
                prefix = "/".join(parts[:depth])
                inner = FileEntry(entry.path[len(prefix) + 1:], entry.size, entry.version)
                folders.setdefault(prefix, []).append(inner)
    for prefix in sorted(folders, key=lambda p: (p.count("/"), _natural(p))):
        if any(layout.detect(folders[prefix]) for layout in candidates):
            return url.rstrip("/") + "/" + prefix
    return None


def _natural(text: str) -> list:
    """Sort key: ``global_step_9`` before ``global_step_10``."""
    import re

    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", text)]


def listing_verdicts(files: Sequence[FileEntry]) -> list[tuple[str, Verdict]]:
    """(name, verdict) of every layout present in a listing, in priority order (names and sizes only)."""
    found = []
    for layout in LAYOUTS:
        verdict = layout.listing_verdict(files)
        if verdict.present:
            found.append((layout.name, verdict))
    return found


def check_checkpoint(url: str, backend: str | None = None, files: Sequence[FileEntry] | None = None) -> Checkpoint:
    """List ``url`` once (or take ``files``, its listing as discovery made it: paths relative to ``url``),
    pick the layout (or use ``backend``, a layout or an alias), check completeness. The checkpoint carries
    what the check learned (`Checkpoint.lora`, `Checkpoint.index`): `open_checkpoint` reads no header again.

    A local folder holding a link out of it or a special file is refused first (`UnsafeFile`,
    `merge_engine.storage.source_files`): no byte of it is read."""
    if backend and backend not in ALIASES:
        layout_named(backend)  # an unknown name is refused before the listing is judged
    check_local_tree(url)
    files = storage.list_files(url) if files is None else list(files)
    checkpoint = find_layout(url, files, backend).check_complete(url, files)
    return refined(checkpoint, files if checkpoint.url == url else checkpoint.files)


def refined(checkpoint: Checkpoint, files: Sequence[FileEntry]) -> Checkpoint:
    """``checkpoint`` as the first layout that refines its layout claims it (`Layout.refines`: a LoRA run's
    dist checkpoint), from what its check carried; else as it is. ``files``: the listing, relative to its URL."""
    for layout in LAYOUTS:
        if layout.refine is not None and layout.refines == checkpoint.layout:
            found = layout.refine(checkpoint, files)
            if found is not None:
                return found
    return checkpoint


def open_checkpoint(checkpoint: Checkpoint) -> TensorSource:
    return layout_named(checkpoint.layout).open(checkpoint)


def open_hf_folder(url: str, files: Sequence[FileEntry] | None = None) -> TensorSource:
    """The tensors of the Hugging Face folder at ``url`` (a base model, a reference), checked complete first
    (``files``: its listing, already made)."""
    return open_checkpoint(check_checkpoint(url, hf.NAME, files))


def check_unchanged(checkpoint: Checkpoint) -> None:
    """`SourceChanged` naming the first of ``checkpoint.files`` that a fresh listing shows gone, resized or
    of another version. Run after a job has read everything it reads and before its provenance is
    written: the two agreeing listings bracket every read, the whole-file ones (config, tokenizer,
    chat template: not pinned one by one) included, so the fingerprint recorded is of what was read."""
    now = {e.path: e for e in storage.list_files(checkpoint.url)}
    for entry in checkpoint.files:
        fresh = now.get(entry.path)
        if fresh is None or (fresh.size, fresh.version) != (entry.size, entry.version):
            state = "is gone" if fresh is None else f"is now {fresh.size} bytes, version {fresh.version}"
            raise SourceChanged(f"changed during the job: listed as {entry.size} bytes, version {entry.version}; "
                                f"it {state}", storage.join(checkpoint.url, entry.path))
