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
hands it here once `merge_engine.layouts.megatron_dist.check_complete` has seen adapter keys in its
``.metadata`` (`merge_engine.layouts.check_checkpoint`).

Listing verdict: the v2 marker; complete with the reason "adapter only" (an adapter release can be
made; a fused model needs ``--base-model``). Discovery then reads the marker itself (`marker_verdict`: one
small JSON through the guarded reader), so a step the names cannot tell from a dist checkpoint
(``use_dist_checkpointing: true``, or no PEFT export) is called ``megatron_lora`` too, with what its merge
needs that the step does not record (`NEEDS_*`: ``base_model``, ``lora_alpha``, ``hf_model_path``). `check_complete` reads ``ckpt_contents.json`` and the
dist index (no weight): adapter keys present, the PEFT folder complete when the marker names one.
`open` gives the canonical Megatron tensors (`merge_engine.layouts.megatron_dist`), the adapter's
among them (``decoder.layers.N.<module>.adapter.linear_in.weight``); `holds_base` and
`adapter_folder` say what else the step gives. Importing this module imports no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from merge_engine import storage
from merge_engine.errors import IncompleteCheckpoint, StepmergeError, UnsupportedLayout
from merge_engine.formats.json_file import read_json_object
from merge_engine.layouts import megatron_dist, verl_v2
from merge_engine.layouts.contract import ABSENT, COMPLETE, MEGATRON_NAMES, Checkpoint, Verdict
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
ADAPTER_KEY = megatron_dist.ADAPTER_KEY  # ``...linear_qkv.adapter.linear_in.weight``
# what `check_complete` found, recorded in `Checkpoint.notes` (read back by `holds_base`, `adapter_folder`)
NOTE = "verl Megatron LoRA step"
NOTE_BASE_IN_STEP = "base weights in model/dist_ckpt (use_dist_checkpointing)"
NOTE_ADAPTER_ONLY = "adapter only: a fused model needs --base-model (the model the run trained from)"
NOTE_PEFT_FOLDER = "PEFT folder: model/huggingface/adapter"
ADAPTER_ONLY_REASON = ("a LoRA adapter step (base weights not saved): the adapter can be released; "
                       "a fused model needs --base-model")


# what a merge of the step needs that the step does not record (the flows' parameter names)
NEEDS_BASE_MODEL = "base_model"  # the adapter only was saved: the model the run trained from
NEEDS_LORA_ALPHA = "lora_alpha"  # no PEFT export: nothing in the step records alpha
NEEDS_HF_MODEL_PATH = "hf_model_path"  # base in the step but no model/huggingface/config.json
MARKER_MAX_BYTES = 1 << 20  # the largest ckpt_contents.json discovery reads (verl's: a few KB)
CLI_FLAGS = {NEEDS_BASE_MODEL: "--base-model", NEEDS_LORA_ALPHA: "--lora-alpha", NEEDS_HF_MODEL_PATH: "--hf_model_path"}


def _top(files: Sequence[FileEntry], folder: str) -> list[str]:
    return [f.path[len(folder):] for f in files if f.path.startswith(folder) and "/" not in f.path[len(folder):]]


def detect(files: Sequence[FileEntry]) -> bool:
    return any(f.path == ADAPTER_DIR + ADAPTER_CONFIG for f in files)


def listing_verdict(files: Sequence[FileEntry]) -> Verdict:
    """The v2 marker decides; a complete step says that it holds an adapter, not a model."""
    if not detect(files):
        return ABSENT
    verdict = verl_v2.marker_verdict(files)
    return Verdict(COMPLETE, ADAPTER_ONLY_REASON) if verdict.complete else verdict


def _section(obj: dict, key: str) -> dict:
    value = obj.get(key)
    return value if isinstance(value, dict) else {}


def _lora_marker(contents: dict) -> bool:
    """Does verl's manifest say the run trained a PEFT adapter (``backend.peft``, ``contents.peft_adapters``
    or ``contents.model.peft_adapter_path``)?"""
    backend, inner = _section(contents, "backend"), _section(contents, "contents")
    model = _section(inner, "model")
    return backend.get("peft") is True or "peft_adapters" in inner or bool(model.get("peft_adapter_path"))


def step_needs(contents: dict, files: Sequence[FileEntry]) -> tuple[str, ...]:
    """What a merge of this LoRA step needs that it does not record (`NEEDS_*`), from its marker and listing:
    ``base_model`` unless the base was saved (``backend.use_dist_checkpointing``), ``lora_alpha`` unless the
    PEFT export is there (its ``adapter_config.json``), ``hf_model_path`` for a step with its base but no
    config.json (a base model's config would do too, but a step holding its base has no base to name)."""
    base_in_step = _section(contents, "backend").get("use_dist_checkpointing") is True
    names = {f.path for f in files}
    declared = _section(_section(contents, "contents"), "model").get("peft_adapter_path")
    folder = (declared.rstrip("/") + "/") if isinstance(declared, str) and declared else ADAPTER_DIR
    needs = []
    if not base_in_step:
        needs.append(NEEDS_BASE_MODEL)
    if folder + ADAPTER_CONFIG not in names:
        needs.append(NEEDS_LORA_ALPHA)
    if base_in_step and HF_DIR + "config.json" not in names:
        needs.append(NEEDS_HF_MODEL_PATH)
    return tuple(needs)


def marker_verdict(url: str, files: Sequence[FileEntry]) -> tuple[Verdict, tuple[str, ...]] | None:
    """Discovery's second look at a complete step with verl's marker: (verdict, needs) when
    ``ckpt_contents.json`` says the run trained LoRA, None when it does not. Reads the marker only, and only
    when the listing shows it no larger than `MARKER_MAX_BYTES` (verl's are a few KB); a marker that is
    larger or cannot be parsed leaves the listing's verdict (None): ``check`` reads it again and names the
    fault (`check_complete`), so discovery never fails a whole run root for one step's file."""
    entry = next((f for f in files if f.path == MARKER), None)
    if entry is None or entry.size > MARKER_MAX_BYTES:
        return None
    try:
        contents = read_json_object(storage.join(url, MARKER))
    except (StepmergeError, FileNotFoundError):
        return None
    if contents is None or not _lora_marker(contents):
        return None
    needs = step_needs(contents, files)
    held = ("base and adapter saved (use_dist_checkpointing)" if NEEDS_BASE_MODEL not in needs
            else "base weights not saved")
    reason = f"a LoRA step (Megatron-Bridge PEFT, {held})"
    if needs:
        reason += "; a merge needs " + ", ".join(f"{n} ({CLI_FLAGS[n]})" for n in needs)
    return Verdict(COMPLETE, reason), needs


def is_adapter_key(key: str) -> bool:
    return ADAPTER_KEY in key


def check_complete(url: str, files: list[FileEntry]) -> Checkpoint:
    """The step complete (marker), its dist index readable and holding adapter keys, the PEFT folder the
    marker names complete; reads ``ckpt_contents.json``, ``.metadata`` and small JSON files, no weight."""
    from merge_engine.formats.dcp_file_names import METADATA_FILE
    from merge_engine.formats.torch_dcp import read_index

    paths = {f.path: f for f in files}
    if MARKER not in paths:
        raise IncompleteCheckpoint(f"{MARKER} (written last by verl) not present yet", storage.join(url, MARKER))
    contents = read_json_object(storage.join(url, MARKER)) or {}
    model = (contents.get("contents") or {}).get("model") or {}
    dist_url = storage.join(url, DIST_DIR.rstrip("/"))
    for required in (METADATA_FILE, megatron_dist.MEGATRON_METADATA):
        if DIST_DIR + required not in paths:
            raise IncompleteCheckpoint(f"{required} missing: verl saves the adapter weights in model/dist_ckpt/",
                                       storage.join(dist_url, required))
    index = read_index(dist_url)
    megatron_dist.check_files(index, dist_url, {p[len(DIST_DIR):]: f for p, f in paths.items()
                                                if p.startswith(DIST_DIR) and "/" not in p[len(DIST_DIR):]})
    adapter_keys = [k for k in index.tensors if is_adapter_key(k)]
    if not adapter_keys:
        raise UnsupportedLayout("model/dist_ckpt holds no LoRA adapter (no '.adapter.linear_in' keys) and "
                                "model/huggingface holds no weights: nothing here to merge", dist_url)
    base_in_step = any(megatron_dist.is_model_key(k) and not is_adapter_key(k) for k in index.tensors)
    notes = [NOTE, NOTE_BASE_IN_STEP if base_in_step else NOTE_ADAPTER_ONLY]
    declared = model.get("peft_adapter_path")
    folder = (declared.rstrip("/") + "/") if isinstance(declared, str) and declared else None
    if folder is not None and (not folder.startswith(HF_DIR) or ".." in folder.split("/")):
        raise UnsupportedLayout(f"{MARKER} names the PEFT folder {declared!r}, outside model/huggingface/",
                                storage.join(url, MARKER))
    if folder is None and ADAPTER_DIR + ADAPTER_CONFIG in paths:
        folder = ADAPTER_DIR
    if folder is not None:
        for required in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
            entry = paths.get(folder + required)
            if entry is None or entry.size == 0:
                raise IncompleteCheckpoint(f"the PEFT adapter folder {MARKER} names lacks {required}",
                                           storage.join(url, folder + required))
        notes.append(NOTE_PEFT_FOLDER if folder == ADAPTER_DIR else f"PEFT folder: {folder.rstrip('/')}")
    hf_top = _top(files, HF_DIR)
    hf_dir = storage.join(url, HF_DIR.rstrip("/")) if "config.json" in hf_top else None
    keep = [f for f in files if f.path.startswith(DIST_DIR) or f.path in (MARKER, megatron_dist.TRANSFORMER_CONFIG)
            or (f.path.startswith(HF_DIR) and "/" not in f.path[len(HF_DIR):])
            or (folder is not None and f.path.startswith(folder) and "/" not in f.path[len(folder):])]
    entries = tuple(sorted(keep, key=lambda f: f.path))
    return Checkpoint(url=url, layout=NAME, files=entries, parallel=megatron_dist.parallel_sizes(url, files),
                      hf_dir=hf_dir, fingerprint=storage.fingerprint(entries), notes=tuple(notes), lora=True)


def holds_base(checkpoint: Checkpoint) -> bool:
    """Does the step hold its base weights (``use_dist_checkpointing: true``)?"""
    return NOTE_BASE_IN_STEP in checkpoint.notes


def adapter_folder(checkpoint: Checkpoint) -> str | None:
    """URL of the step's PEFT folder (``save_hf_adapter``'s), or None when the step has none."""
    for note in checkpoint.notes:
        if note.startswith("PEFT folder: "):
            return storage.join(checkpoint.url, note[len("PEFT folder: "):])
    return None


def open(checkpoint: Checkpoint) -> TensorSource:  # noqa: A001 - the layout contract's verb
    """The canonical Megatron tensors of ``model/dist_ckpt`` (adapter, and base when saved), lazily."""
    dist = Checkpoint(url=checkpoint.url, layout=megatron_dist.NAME, files=checkpoint.files,
                      parallel=checkpoint.parallel, hf_dir=checkpoint.hf_dir)
    return megatron_dist.open(dist)
