"""Megatron runs saved through a bridge (verl's default since late 2025): the weights are already a
Hugging Face model in ``model/huggingface/`` (verl 0.9) or ``huggingface/`` (older), next to
Megatron state (``extra/dist_ckpt/``, ``dist_ckpt/``, ``transformer_config.json``, ...); or Megatron-Bridge's
``iter_N/hf/`` beside the native ``torch_dist`` checkpoint at the top of ``iter_N/`` (``common.pt``,
``metadata.json``, ``.metadata``).

Completeness: the verl v2 marker ``ckpt_contents.json`` when the layout is v2; the Hugging Face
folder complete by `merge_engine.layouts.hf`'s rules (index valid, every file it names present,
every header parsed); and every tensor the config implies present, by the family table
(`merge_engine.architectures`): a bridge export missing a layer is refused, not passed through.
`open` passes the Hugging Face tensors through unchanged (the Hugging Face planner merges them).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from merge_engine import storage
from merge_engine.errors import IncompleteCheckpoint, UnknownArchitecture
from merge_engine.formats.hf_metadata import read_config
from merge_engine.layouts import hf, megatron_dist, verl_v2
from merge_engine.layouts.contract import ABSENT, HF_NAMES, Checkpoint, Layout, Verdict
from merge_engine.storage import FileEntry

if TYPE_CHECKING:
    from merge_engine.formats.tensor_source import TensorSource

NAME = "megatron_bridge"
TENSOR_NAMING = HF_NAMES
V2_MARKER = verl_v2.CONTENTS_MARKER
HF_FOLDERS = hf.SAVED_BESIDE
# files only a Megatron run leaves beside its Hugging Face export (an FSDP step has its own layout)
MEGATRON_MARKERS = ("transformer_config.json", V2_MARKER, "common.pt", "metadata.json")
MEGATRON_FOLDERS = ("dist_ckpt/", "model/dist_ckpt/", "extra/dist_ckpt/", "optimizer/dist_ckpt/")


def _hf_folder(files: Sequence[FileEntry]) -> str | None:
    for folder in HF_FOLDERS:
        if any(f.path.startswith(folder) and f.path.endswith(".safetensors") and "/" not in f.path[len(folder):]
               for f in files):
            return folder
    return None


def detect(files: Sequence[FileEntry]) -> bool:
    if _hf_folder(files) is None:
        return False
    return any(f.path in MEGATRON_MARKERS or f.path.startswith(MEGATRON_FOLDERS) for f in files)


def listing_verdict(files: Sequence[FileEntry]) -> Verdict:
    """The Hugging Face weights' verdict (`hf.listing_verdict`: verl v2's marker, or the index), and
    when a ``dist_ckpt/`` is saved beside them, its own (`megatron_dist.listing_verdict`) too."""
    if not detect(files):
        return ABSENT
    verdict = hf.listing_verdict(files)
    beside = megatron_dist.listing_verdict(files)
    return beside if verdict.complete and beside.present else verdict


def _sub_files(files: list[FileEntry], folder: str) -> list[FileEntry]:
    return [FileEntry(f.path[len(folder):], f.size, f.version) for f in files
            if f.path.startswith(folder) and "/" not in f.path[len(folder):]]


def check_complete(url: str, files: list[FileEntry]) -> Checkpoint:
    """The export complete and holding every tensor its config implies (see module docstring)."""
    folder = _hf_folder(files)
    if folder is None:
        raise IncompleteCheckpoint("no safetensors weights in huggingface/, model/huggingface/ or hf/", url)
    if folder == "model/huggingface/" and not any(f.path == V2_MARKER for f in files):
        raise IncompleteCheckpoint(f"{V2_MARKER} (written last by verl) not present yet", storage.join(url, V2_MARKER))
    beside = megatron_dist.listing_verdict(files)
    if beside.present and not beside.complete:  # the listing's rule: the Megatron state saved with it, whole
        raise IncompleteCheckpoint(f"the Megatron checkpoint beside the export is not complete: {beside.reason}", url)
    hf_url = storage.join(url, folder.rstrip("/"))
    inner = hf.check_complete(hf_url, _sub_files(files, folder))
    notes = _check_tensor_set(inner)
    entries = tuple(sorted([f for f in files if f.path.startswith(folder) and "/" not in f.path[len(folder):]]
                           + [f for f in files if f.path in MEGATRON_MARKERS], key=lambda f: f.path))
    return Checkpoint(url=url, layout=NAME, files=entries, parallel=megatron_dist.parallel_sizes(url, files),
                      hf_dir=hf_url,
                      fingerprint=storage.fingerprint(entries), notes=("bridge export", *notes), lora=inner.lora,
                      index=inner.index)  # the export's headers and index, as `hf.check_complete` read them


def _check_tensor_set(inner: Checkpoint) -> tuple[str, ...]:
    """Every Hugging Face tensor the family table expects for this config is in the export."""
    from merge_engine.architectures import model_dims, table_for_config  # the family tables: only a check needs them
    from merge_engine.architectures.binding import expected_bindings

    config = read_config(inner.hf_dir)
    try:
        table = table_for_config(config)
    except UnknownArchitecture:
        return ("the config's model family has no table: the tensor set was not checked against it",)
    dims = model_dims(config, table)
    present = hf.tensor_names(inner)  # headers only: a check builds no tensor source (no torch)
    expected = [name for b in expected_bindings(table, config, dims) for name in b.hf]
    missing = [name for name in expected if name not in present]
    if missing:
        raise IncompleteCheckpoint(f"the export lacks {len(missing)} tensor(s) config.json implies, e.g. "
                                   f"{missing[0]!r}", inner.url)
    return ()


def open(checkpoint: Checkpoint) -> TensorSource:  # noqa: A001 - the layout contract's verb
    assert checkpoint.hf_dir is not None
    folder = next(f for f in HF_FOLDERS if storage.join(checkpoint.url, f.rstrip("/")) == checkpoint.hf_dir)
    inner = Checkpoint(url=checkpoint.hf_dir, layout=hf.NAME, files=tuple(_sub_files(list(checkpoint.files), folder)),
                       hf_dir=checkpoint.hf_dir, index=checkpoint.index)
    return hf.open(inner)


LAYOUT = Layout(
    name=NAME,
    tensor_naming=TENSOR_NAMING,
    detect=detect,
    listing_verdict=listing_verdict,
    check_complete=check_complete,
    open=open,
)
