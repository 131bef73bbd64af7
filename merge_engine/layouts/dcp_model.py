"""A model's state dict saved with ``torch.distributed.checkpoint.save`` (DCP), as the trainers built on it save one.

Where the model's DCP folder is, relative to the checkpoint folder (`MODEL_FOLDERS`, looked for in this order):

- Accelerate / HF Trainer / TRL under FSDP ``SHARDED_STATE_DICT``: ``checkpoint-N/pytorch_model_fsdp_0/`` (keys
  ``model.<name>``: Accelerate saves ``{"model": state_dict}``), beside ``optimizer_0/`` (ignored);
- NeMo-RL's DTensor policy: ``step_N/policy/weights/`` (``{"model": ModelState}``: keys ``model.<name>``);
- the folder itself: a plain ``dcp.save(model.state_dict())`` (bare names), torchtitan's ``step-N/`` (its model
  state flattened to the top, its optimizer, schedulers and dataloader nested under their own keys: ignored).

A PEFT-wrapped model (HF Trainer / TRL with PEFT) is saved under PEFT's names: the whole model
(``base_model.model.<name>.base_layer.weight``, ``lora_A.default.weight``...) by Accelerate's own save, its adapter
only (``lora_A.weight``, no base) by HF Trainer's (``save_fsdp_model(..., adapter_only=True)``). Such a checkpoint is
a LoRA one (`Checkpoint.lora`): ``merge`` fuses it, ``extract-lora`` writes its adapter; ``lora_alpha`` comes from
``adapter_config.json`` beside the DCP folder when the run saved one (PEFT's own ``save_pretrained``), else from
``--lora-alpha``, never guessed.

Names: DCP's default planner records how it flattened the nested state dict (`DcpIndex.paths`); a tensor of the
model is one whose path is ``("model", name)`` or a top-level ``(name,)``; nested optimizer or scheduler state is
not the model's. torchtitan's own module names (``tok_embeddings``, ``layers.N.attention.wq``) are not the
Hub's: a checkpoint of them is `merge_engine.layouts.torchtitan`'s (it refines this layout's check).

Complete: ``.metadata`` present (DCP's coordinator writes it, through a temporary name, after every rank's data),
and every data file it names present and long enough (`megatron_dist.check_files`). A Megatron ``torch_dist``
folder is DCP too: its ``common.pt`` (written before the DCP save starts) or ``metadata.json`` marks it as
`merge_engine.layouts.megatron_dist`'s, never this layout's.

Importing this module imports no torch: the DCP reader is imported by `check_complete` and `open`.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import TYPE_CHECKING

from merge_engine import storage
from merge_engine.errors import UnsupportedLayout
from merge_engine.formats.dcp_file_names import DATA_SUFFIX, METADATA_FILE
from merge_engine.formats.hf_metadata import CONFIG_FILE
from merge_engine.layouts.contract import (
    ABSENT, DONE, HF_NAMES, INCOMPLETE, RUN_LORA_FILES, Checkpoint, Layout, StepLook, Verdict, holds_lora,
)
from merge_engine.storage import FileEntry

if TYPE_CHECKING:
    from merge_engine.formats.dcp_index import DcpIndex
    from merge_engine.formats.tensor_source import TensorSource

NAME = "torch_dcp"
TENSOR_NAMING = HF_NAMES
# (folder relative to the checkpoint, who writes it there), in detection order
MODEL_FOLDERS: tuple[tuple[str, str], ...] = (
    ("pytorch_model_fsdp_0/", "Accelerate / HF Trainer FSDP SHARDED_STATE_DICT"),
    ("weights/", "NeMo-RL DTensor policy"),
    ("policy/weights/", "NeMo-RL DTensor policy"),
    ("", "torch.distributed.checkpoint"),
)
# files megatron-core writes in a torch_dist folder (common.pt before the DCP save, metadata.json after it)
MEGATRON_FILES = ("common.pt", "metadata.json")
TEMPORARY_METADATA = METADATA_FILE + ".tmp"  # FileSystemWriter writes .metadata here, then renames it
MODEL_KEY = "model"  # the top-level key Accelerate and NeMo-RL save the model's state dict under
# torchtitan's own module names: a state dict of them is not the Hub's
TORCHTITAN_NAME = re.compile(r"^(?:tok_embeddings\.weight|layers\.[0-9]+\.(?:attention|feed_forward)\.w\w*\.weight)$")
WRAPPER_PREFIXES = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")


def _is_dcp_file(name: str) -> bool:
    return name in (METADATA_FILE, TEMPORARY_METADATA) or (name.endswith(DATA_SUFFIX) and name.startswith("__"))


def _folder(files: Sequence[FileEntry]) -> tuple[str, str] | None:
    """(folder, writer) of the model's DCP folder in the listing; None when there is none."""
    for folder, writer in MODEL_FOLDERS:
        inside = [f.path[len(folder):] for f in files if f.path.startswith(folder) and "/" not in f.path[len(folder):]]
        if any(_is_dcp_file(name) for name in inside):
            if any(name in MEGATRON_FILES for name in inside):
                return None  # a Megatron torch_dist folder
            return folder, writer
    return None


def _top(files: Sequence[FileEntry], folder: str) -> dict[str, FileEntry]:
    """The files straight inside ``folder`` (``""`` or ending in ``/``), by their names there."""
    return {f.path[len(folder):]: f for f in files if f.path.startswith(folder) and "/" not in f.path[len(folder):]}


def detect(files: Sequence[FileEntry]) -> bool:
    return _folder(files) is not None


def listing_verdict(files: Sequence[FileEntry]) -> Verdict:
    """Complete once ``.metadata`` is listed (DCP writes it last, after every rank's data, by a rename)."""
    found = _folder(files)
    if found is None:
        return ABSENT
    folder = found[0]
    if not any(f.path == folder + METADATA_FILE for f in files):
        return Verdict(INCOMPLETE, f"{folder or './'} data files present but {METADATA_FILE} not written yet")
    return DONE


NEEDS_CONFIG = "hf_model_path"  # the merge parameter naming a config for a step saved without one


def second_look(url: str, files: Sequence[FileEntry]) -> StepLook | None:
    """Discovery's look at a complete step of this layout (`Layout.second_look`; reads nothing): one saved
    without ``config.json`` (HF Trainer under SHARDED_STATE_DICT saves none) needs ``hf_model_path``; None
    otherwise (the listing's verdict stands)."""
    found = _folder(files)
    if found is None or _config_dir(url, files, found[0]) is not None:
        return None
    verdict = listing_verdict(files)
    return StepLook(NAME, Verdict(verdict.status, "no config.json saved with the weights"), (NEEDS_CONFIG,)) \
        if verdict.complete else None


def model_names(index: DcpIndex, url: str) -> dict[str, str]:
    """Hub name -> DCP key of every tensor of the model in ``index`` (see the module docstring; torchtitan's own
    names are kept: `merge_engine.layouts.torchtitan` refines such a checkpoint). Raises `UnsupportedLayout` for a
    folder holding no model tensor."""
    names: dict[str, str] = {}
    for key in index.tensors:
        path = index.paths.get(key, (key,))
        if len(path) == 2 and path[0] == MODEL_KEY:
            name = path[1]
        elif len(path) == 1 and not key.startswith(("optimizer.", "lr_scheduler", "dataloader", "train_state")):
            name = path[0]
        else:
            continue
        for prefix in WRAPPER_PREFIXES:
            name = name.replace(prefix, "")
        if name in names:
            raise UnsupportedLayout(f"{NAME}: keys {names[name]!r} and {key!r} both name {name!r}", url)
        names[name] = key
    if not names:
        kinds = sorted({key.split(".")[0] for key in list(index.tensors) + list(index.objects)})
        raise UnsupportedLayout(f"{NAME}: this DCP folder holds no model weights, only {', '.join(kinds) or 'nothing'}"
                                " (optimizer / trainer state)", url)
    return names


def _hub_index(index: DcpIndex, names: dict[str, str]) -> DcpIndex:
    """``index`` keyed by Hub names, the model's tensors only."""
    from merge_engine.formats.dcp_index import DcpIndex

    return DcpIndex(index.url, {name: index.tensors[key] for name, key in names.items()}, {})


def _config_dir(url: str, files: Sequence[FileEntry], folder: str) -> str | None:
    """The folder holding ``config.json``: the checkpoint folder, else the DCP folder; None: neither (a trainer
    that saves no config: ``--hf_model_path`` names one)."""
    paths = {f.path for f in files}
    for where in ("", folder):
        if where + CONFIG_FILE in paths:
            return storage.join(url, where.rstrip("/")) if where else url
    return None


def check_complete(url: str, files: list[FileEntry]) -> Checkpoint:
    """``.metadata`` read with the allow-list unpickler, every data file it names present with its size, the
    model's tensors named; the index of the model (by Hub name) carried (`Checkpoint.index`)."""
    from merge_engine.errors import IncompleteCheckpoint
    from merge_engine.formats.dcp_index import read_index
    from merge_engine.layouts.megatron_dist import check_files
    from merge_engine.layouts.tensor_index import carry_dcp

    found = _folder(files)
    if found is None:
        raise IncompleteCheckpoint(f"no {METADATA_FILE} or {DATA_SUFFIX} files of a DCP save here", url)
    folder, writer = found
    folder_url = storage.join(url, folder.rstrip("/")) if folder else url
    inside = _top(files, folder)
    index = read_index(folder_url, layout=NAME)
    check_files(index, folder_url, inside)
    names = model_names(index, folder_url)
    hf_dir = _config_dir(url, files, folder)
    metadata_folder = "" if hf_dir == url else folder  # config, tokenizer: what the merge copies, in its fingerprint
    keep = [f for name, f in inside.items() if _is_dcp_file(name)]
    if hf_dir is not None:
        keep += [f for name, f in _top(files, metadata_folder).items() if not _is_dcp_file(name)]
    keep += [f for name, f in _top(files, "").items() if name in RUN_LORA_FILES]  # the run's LoRA settings
    entries = tuple(sorted({f.path: f for f in keep}.values(), key=lambda f: f.path))
    ranks = {name.split("_")[2] for name in index.files() if name.count("_") >= 3}
    return Checkpoint(url=url, layout=NAME, files=entries, parallel={"world_size": len(ranks)} if ranks else {},
                      hf_dir=hf_dir, fingerprint=storage.fingerprint(entries), notes=(writer,),
                      lora=holds_lora(names), index=carry_dcp(_hub_index(index, names)))


def _located(checkpoint: Checkpoint) -> str:
    found = _folder(checkpoint.files)
    if found is None:
        raise UnsupportedLayout(f"{NAME}: the checked listing holds no DCP folder", checkpoint.url)
    return found[0]


def open(checkpoint: Checkpoint) -> TensorSource:  # noqa: A001 - the layout contract's verb
    """The model's tensors by Hub name, lazily (the carried index; else ``.metadata`` read again)."""
    from merge_engine.formats.dcp_index import read_index
    from merge_engine.formats.tensor_source import AssembledSource
    from merge_engine.formats.torch_dcp import DcpFiles, DcpTensor
    from merge_engine.layouts.tensor_index import restore_dcp

    folder = _located(checkpoint)
    folder_url = storage.join(checkpoint.url, folder.rstrip("/")) if folder else checkpoint.url
    index = restore_dcp(checkpoint, folder)
    if index is None:
        full = read_index(folder_url, layout=NAME)
        index = _hub_index(full, model_names(full, folder_url))
    listed = [f for f in checkpoint.files if f.path.startswith(folder) and "/" not in f.path[len(folder):]]
    files = DcpFiles(folder_url, {f.path[len(folder):]: f.size for f in listed},
                     {f.path[len(folder):]: f.version for f in listed})
    tensors = {name: DcpTensor(name, info, files) for name, info in index.tensors.items()}
    return AssembledSource(checkpoint.url, tensors, [files])


LAYOUT = Layout(
    name=NAME,
    tensor_naming=TENSOR_NAMING,
    detect=detect,
    listing_verdict=listing_verdict,
    check_complete=check_complete,
    open=open,
    second_look=second_look,
)
