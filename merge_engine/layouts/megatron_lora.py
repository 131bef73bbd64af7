"""verl Megatron LoRA steps (verl 0.9 + Megatron-Bridge PEFT), schema v2.

What such a step holds (verl's ``MegatronCheckpointManager``; ``ckpt_contents.json`` written LAST):

- ``use_dist_checkpointing: false`` (the default, bridge on): ``model/dist_ckpt/`` holds the ADAPTER
  ONLY (torch_dist keys ``<module>.adapter.linear_in.weight`` / ``.adapter.linear_out.weight`` of the
  fused ``linear_qkv``, SwiGLU ``linear_fc1``, grouped experts with their expert axis);
  ``model/huggingface/`` config + tokenizer and NO base weights; ``model/huggingface/adapter/`` the
  PEFT folder Megatron-Bridge's ``save_hf_adapter`` wrote (``contents.model.peft_adapter_path``).
  A fused model needs a base the user names.
- ``use_dist_checkpointing: true``: ``model/dist_ckpt/`` holds base AND adapter, no PEFT folder, no
  ``model/huggingface/``: the step is the trained model on its own (config from ``--hf_model_path``).

Detection (names only): the PEFT folder's ``adapter_config.json``. A step without one (``use_dist_checkpointing:
true``, or a run whose bridge export is missing) lists like any dist checkpoint (a non-LoRA verl v2 step
also has ``model/huggingface/config.json`` without weights: names cannot tell them apart); the registry
hands it here (`Layout.refines`, `refine`) once `merge_engine.layouts.megatron_dist.check_complete` has seen adapter
keys in its ``.metadata`` (`Checkpoint.lora`), from what that check carried: nothing is read again.

Listing verdict: the v2 marker; complete with the reason "adapter only" (an adapter release can be
made; a fused model needs ``--base-model``). Discovery then reads the marker itself (`second_look`: one
small JSON through the guarded reader), so a step the names cannot tell from a dist checkpoint
(``use_dist_checkpointing: true``, or no PEFT export) is this layout too, with what its merge needs that
the step does not record (`NEEDS_*`: ``base_model``, ``lora_alpha``, ``hf_model_path``). `check_complete`
reads ``ckpt_contents.json`` and the dist index once (no weight): adapter keys present, the PEFT folder
complete when the marker names one; the checkpoint's typed facts say what else the step gives
(``adapter_only``; ``adapter_dir``, the PEFT folder: `adapter_folder`). `open` gives the canonical Megatron
tensors (`merge_engine.layouts.megatron_dist`), the adapter's among them
(``decoder.layers.N.<module>.adapter.linear_in.weight``). Its jobs: `merge_engine.commands.megatron_lora`.
Importing this module imports no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from merge_engine import storage
from merge_engine.errors import IncompleteCheckpoint, StepmergeError, UnsupportedLayout
from merge_engine.formats.json_file import read_json_object
from merge_engine.layouts import megatron_dist, verl_v2
from merge_engine.layouts.contract import ABSENT, COMPLETE, MEGATRON_NAMES, Checkpoint, Layout, StepLook, Verdict
from merge_engine.options import MergeArgs, flag_name
from merge_engine.storage import FileEntry

if TYPE_CHECKING:
    from merge_engine.formats.tensor_source import TensorSource

NAME = "megatron_lora"
TENSOR_NAMING = MEGATRON_NAMES
MARKER = verl_v2.CONTENTS_MARKER
DIST_DIR = verl_v2.MODEL_DIST_DIR
HF_DIR = verl_v2.MODEL_HF_DIR
ADAPTER_DIR = HF_DIR + "adapter/"  # save_hf_adapter's folder (verl: ``<hf path>/adapter``)
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
NOTE = "verl Megatron LoRA step"  # `Checkpoint.notes`, for a person; the facts are its typed fields
# what a merge of the step needs that the step does not record: the merge options (`MergeArgs` fields, the
# engine's `OutputOptions` fields of the same names) a user must give
NEEDS_BASE_MODEL = "base_model"  # the adapter only was saved: the model the run trained from
NEEDS_LORA_ALPHA = "lora_alpha"  # no PEFT export: nothing in the step records alpha
NEEDS_HF_MODEL_PATH = "hf_model_path"  # base in the step but no model/huggingface/config.json
MARKER_MAX_BYTES = 1 << 20  # the largest ckpt_contents.json discovery reads (verl's: a few KB)
CLI_FLAGS = {need: flag_name(MergeArgs, need) for need in (NEEDS_BASE_MODEL, NEEDS_LORA_ALPHA, NEEDS_HF_MODEL_PATH)}
ADAPTER_ONLY_REASON = ("a LoRA adapter step (base weights not saved): the adapter can be released; "
                       f"a fused model needs {CLI_FLAGS[NEEDS_BASE_MODEL]}")


def detect(files: Sequence[FileEntry]) -> bool:
    return any(f.path == ADAPTER_DIR + ADAPTER_CONFIG for f in files)


def listing_verdict(files: Sequence[FileEntry]) -> Verdict:
    """The v2 marker decides; a complete step says that it holds an adapter, not a model."""
    if not detect(files):
        return ABSENT
    verdict = verl_v2.marker_verdict(files)
    return Verdict(COMPLETE, ADAPTER_ONLY_REASON) if verdict.complete else verdict


def step_needs(contents: dict, files: Sequence[FileEntry]) -> tuple[str, ...]:
    """What a merge of this LoRA step needs that it does not record (`NEEDS_*`), from its marker and listing:
    ``base_model`` unless the base was saved (``backend.use_dist_checkpointing``), ``lora_alpha`` unless the
    PEFT export is there (its ``adapter_config.json``), ``hf_model_path`` for a step with its base but no
    config.json (a base model's config would do too, but a step holding its base has no base to name)."""
    base_in_step = verl_v2.saves_base(contents)
    names = {f.path for f in files}
    folder = verl_v2.declared_adapter_dir(contents) or ADAPTER_DIR
    needs = []
    if not base_in_step:
        needs.append(NEEDS_BASE_MODEL)
    if folder + ADAPTER_CONFIG not in names:
        needs.append(NEEDS_LORA_ALPHA)
    if base_in_step and HF_DIR + "config.json" not in names:
        needs.append(NEEDS_HF_MODEL_PATH)
    return tuple(needs)


def second_look(url: str, files: Sequence[FileEntry]) -> StepLook | None:
    """Discovery's second look at a complete step of its own or of ``megatron_dist`` (`Layout.second_look`):
    a `StepLook` when ``ckpt_contents.json`` says the run trained LoRA, None when it does not. Reads the
    marker only, and only when the listing shows it no larger than `MARKER_MAX_BYTES` (verl's are a few KB);
    a marker that is larger or cannot be parsed leaves the listing's verdict: ``check`` reads it again and
    names the fault (`check_complete`), so discovery never fails a whole run root for one step's file. A
    step its names call LoRA (a PEFT export) whose marker says nothing needs its base (the bridge's default)."""
    own = StepLook(NAME, listing_verdict(files), (NEEDS_BASE_MODEL,)) if detect(files) else None
    entry = next((f for f in files if f.path == MARKER), None)
    if entry is None or entry.size > MARKER_MAX_BYTES:
        return own
    try:
        contents = read_json_object(storage.join(url, MARKER))
    except (StepmergeError, FileNotFoundError):
        return own
    if contents is None or not verl_v2.trains_lora(contents):
        return own
    needs = step_needs(contents, files)
    held = ("base and adapter saved (use_dist_checkpointing)" if NEEDS_BASE_MODEL not in needs
            else "base weights not saved")
    reason = f"a LoRA step (Megatron-Bridge PEFT, {held})"
    if needs:
        reason += "; a merge needs " + ", ".join(f"{n} ({CLI_FLAGS[n]})" for n in needs)
    return StepLook(NAME, Verdict(COMPLETE, reason), needs)


def check_complete(url: str, files: list[FileEntry]) -> Checkpoint:
    """The step complete (marker), its dist index readable and holding adapter keys, the PEFT folder the
    marker names complete (`refine` of `megatron_dist.check_complete`: ``ckpt_contents.json``,
    ``.metadata`` and small JSON files read once, no weight)."""
    from merge_engine.formats.dcp_file_names import METADATA_FILE

    paths = {f.path for f in files}
    if MARKER not in paths:
        raise IncompleteCheckpoint(f"{MARKER} (written last by verl) not present yet", storage.join(url, MARKER))
    dist_url = storage.join(url, DIST_DIR.rstrip("/"))
    for required in (METADATA_FILE, megatron_dist.MEGATRON_METADATA):
        if DIST_DIR + required not in paths:
            raise IncompleteCheckpoint(f"{required} missing: verl saves the adapter weights in model/dist_ckpt/",
                                       storage.join(dist_url, required))
    checkpoint = megatron_dist.check_complete(url, files)
    found = refine(checkpoint, files)
    if found is None:
        raise UnsupportedLayout("model/dist_ckpt holds no LoRA adapter (no '.adapter.linear_in' keys) and "
                                "model/huggingface holds no weights: nothing here to merge", dist_url)
    return found


def refine(checkpoint: Checkpoint, files: Sequence[FileEntry]) -> Checkpoint | None:
    """A checked ``megatron_dist`` checkpoint holding a Megatron-Bridge adapter as this layout's (`Layout.refine`):
    from what that check carried (the index, the marker's PEFT folder), no read; None when it holds no adapter.
    `IncompleteCheckpoint` without verl's marker or with a PEFT folder lacking a file, `UnsupportedLayout`
    for a PEFT folder outside ``model/huggingface/``."""
    if checkpoint.layout != megatron_dist.NAME or not checkpoint.lora:
        return None
    url = checkpoint.url
    paths = {f.path: f for f in files}
    if MARKER not in paths:
        raise IncompleteCheckpoint(f"{MARKER} (written last by verl) not present yet", storage.join(url, MARKER))
    folder = checkpoint.adapter_dir
    if folder is not None and (not folder.startswith(HF_DIR) or ".." in folder.split("/")):
        raise UnsupportedLayout(f"{MARKER} names the PEFT folder {folder.rstrip('/')!r}, outside model/huggingface/",
                                storage.join(url, MARKER))
    if folder is None and ADAPTER_DIR + ADAPTER_CONFIG in paths:
        folder = ADAPTER_DIR
    notes = [NOTE, f"adapter only: a fused model needs {CLI_FLAGS[NEEDS_BASE_MODEL]} (the model the run trained from)"
             if checkpoint.adapter_only else "base weights in model/dist_ckpt (use_dist_checkpointing)"]
    if folder is not None:
        for required in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
            entry = paths.get(folder + required)
            if entry is None or entry.size == 0:
                raise IncompleteCheckpoint(f"the PEFT adapter folder {MARKER} names lacks {required}",
                                           storage.join(url, folder + required))
        notes.append(f"PEFT folder: {folder.rstrip('/')}")
    keep = [f for f in files if f.path.startswith(DIST_DIR) or f.path in (MARKER, megatron_dist.TRANSFORMER_CONFIG)
            or (f.path.startswith(HF_DIR) and "/" not in f.path[len(HF_DIR):])
            or (folder is not None and f.path.startswith(folder) and "/" not in f.path[len(folder):])]
    entries = tuple(sorted(keep, key=lambda f: f.path))
    return replace(checkpoint, layout=NAME, files=entries, fingerprint=storage.fingerprint(entries),
                   notes=tuple(notes), adapter_dir=folder)


def adapter_folder(checkpoint: Checkpoint) -> str | None:
    """URL of the step's PEFT folder (``save_hf_adapter``'s), or None when the step has none."""
    return None if checkpoint.adapter_dir is None else storage.join(checkpoint.url, checkpoint.adapter_dir.rstrip("/"))


def open(checkpoint: Checkpoint) -> TensorSource:  # noqa: A001 - the layout contract's verb
    """The canonical Megatron tensors of ``model/dist_ckpt`` (adapter, and base when saved), lazily."""
    return megatron_dist.open(replace(checkpoint, layout=megatron_dist.NAME))


LAYOUT = Layout(
    name=NAME,
    tensor_naming=TENSOR_NAMING,
    detect=detect,
    listing_verdict=listing_verdict,
    check_complete=check_complete,
    open=open,
    refines=megatron_dist.NAME,
    refine=refine,
    second_look=second_look,
)
