"""Hugging Face model folders: ``config.json`` + ``model.safetensors`` or shards with an index.

Used for base models (LoRA fusion), references, and bridge exports (verl's Megatron bridge saves
the actor's weights straight into ``huggingface/``). Completeness: the index (when present) is
valid JSON, names only safe local files (`unsafe_file_name`) that all exist, and every tensor it
maps is found in the header of the file it names, and nowhere else; every header parses. Reading
goes in stages (`read_weight_index` -> `open_weight_files` -> `tensors_by_name` -> `source_of`),
which `merge_engine.validate` also walks, one check per stage. From a listing alone (`listing_verdict`, also for
the weights a training step saves in ``huggingface/`` or verl v2's ``model/huggingface/``): the index
present (transformers writes it after every shard) or a single non-empty ``model.safetensors``; in
``model/huggingface/`` verl v2's marker, written last. Importing this module imports no torch: the
readers are imported by the stages that open files.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from merge_engine import storage
from merge_engine.errors import CorruptShard, IncompleteCheckpoint, UnsafeRecord
from merge_engine.formats.hf_metadata import CONFIG_FILE, INDEX_FILE, SINGLE_FILE
from merge_engine.formats.json_file import read_json_object
from merge_engine.layouts import verl_v2
from merge_engine.layouts.contract import (
    ABSENT, DONE, HF_NAMES, INCOMPLETE, Checkpoint, Layout, Verdict, by_path, holds_lora,
)
from merge_engine.storage import FileEntry

if TYPE_CHECKING:  # the readers import torch: imported when a folder is checked or opened, not with the registry
    from merge_engine.formats.safetensors_file import SafetensorsFile
    from merge_engine.formats.tensor_source import TensorSource
    from merge_engine.formats.stored_tensor import StoredTensor

NAME = "hf"
TENSOR_NAMING = HF_NAMES
# where a training step keeps Hugging Face weights beside its own state (verl v2 first; Megatron-Bridge's ``hf/``
# beside the native checkpoint of ``iter_N/``)
SAVED_BESIDE = (verl_v2.MODEL_HF_DIR, "huggingface/", "hf/")


def detect(files: Sequence[FileEntry]) -> bool:
    top = {f.path for f in files if "/" not in f.path}
    return CONFIG_FILE in top and any(p.endswith(".safetensors") for p in top)


def _weights_folder(files: Sequence[FileEntry]) -> str | None:
    """The folder ("" for the top) holding safetensors weights: the top when `detect`, else a
    ``SAVED_BESIDE`` folder; None when there are none."""
    if detect(files):
        return ""
    for folder in SAVED_BESIDE:
        if any(f.path.startswith(folder) and "/" not in f.path[len(folder):] and f.path.endswith(".safetensors")
               for f in files):
            return folder
    return None


def listing_verdict(files: Sequence[FileEntry]) -> Verdict:
    """See the module docstring: names and sizes only."""
    folder = _weights_folder(files)
    if folder is None:
        return ABSENT
    if folder == verl_v2.MODEL_HF_DIR:
        return verl_v2.marker_verdict(files)
    paths = by_path(files)
    if folder + INDEX_FILE in paths:
        return DONE
    single = paths.get(folder + SINGLE_FILE)
    if single is not None and single.size > 0:
        return DONE
    return Verdict(INCOMPLETE, f"{folder or './'} shards present but {INDEX_FILE} not written yet")


def unsafe_file_name(name: Any) -> str | None:
    """Why ``name`` may not appear in a safetensors index (None when it is a plain, visible
    ``.safetensors`` file name in the folder itself): index entries become paths, so they are not trusted."""
    if not isinstance(name, str) or not name:
        return "not a file name"
    if name.startswith(("/", "\\")) or (len(name) > 1 and name[1] == ":"):
        return "absolute path"
    if "/" in name or "\\" in name:
        return ".. or a sub-folder" if ".." in name.replace("\\", "/").split("/") else "sub-folder"
    if name in (".", ".."):
        return "path traversal"
    if name.startswith("."):
        return "hidden file"
    if "\0" in name:
        return "NUL byte"
    if not name.endswith(".safetensors"):
        return "not a .safetensors file"
    return None


@dataclass(frozen=True)
class WeightIndex:
    """Which safetensors files hold the weights: file -> tensor names the index puts there (empty
    without an index: whatever the one file's header says), and the index's declared total size."""

    files: dict[str, list[str]]
    indexed: bool
    declared_total_size: int | None = None


def read_weight_index(url: str, files: Sequence[FileEntry]) -> WeightIndex:
    """The folder's weight files from its index (or its one safetensors file), all present and non-empty.

    Raises `CorruptShard` for an unreadable or empty index or an unsafe file name in it (the reason
    named), `IncompleteCheckpoint` for a missing or empty file, or neither an index nor one file.
    """
    top = {f.path: f for f in files if "/" not in f.path}
    if INDEX_FILE not in top:
        names = sorted(p for p in top if p.endswith(".safetensors"))
        if len(names) != 1:
            raise IncompleteCheckpoint(
                f"neither {INDEX_FILE} nor a single safetensors file ({len(names)} found)", url)
        return WeightIndex({names[0]: []}, indexed=False)
    index_url = storage.join(url, INDEX_FILE)
    index = read_json_object(index_url) or {}
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise CorruptShard(f"index has no weight_map object (found {type(weight_map).__name__})", index_url)
    metadata = index.get("metadata")
    declared = metadata.get("total_size") if isinstance(metadata, dict) else None
    try:
        declared = None if declared is None else int(declared)
    except (TypeError, ValueError):
        raise CorruptShard(f"index metadata total_size {declared!r} is not a number", index_url) from None
    expected: dict[str, list[str]] = {}
    for tensor, filename in weight_map.items():
        why = unsafe_file_name(filename)
        if why:
            raise CorruptShard(f"index maps {tensor!r} to an unsafe file name {filename!r} ({why})", index_url)
        expected.setdefault(filename, []).append(tensor)
    for filename in expected:
        if filename not in top:
            raise IncompleteCheckpoint(f"index names {filename}, which is missing", storage.join(url, filename))
        if top[filename].size == 0:
            raise IncompleteCheckpoint("weight file is empty", storage.join(url, filename))
    return WeightIndex(expected, indexed=True, declared_total_size=declared)


def open_weight_files(url: str, files: Sequence[FileEntry], index: WeightIndex,
                      headers: dict[str, bytes] | None = None) -> list[SafetensorsFile]:
    """Every weight file opened, its header parsed and checked (`SafetensorsFile`); closed again on failure.
    ``headers``: file name -> its header's JSON as a check carried it, checked again as the file's would be
    (`parse_header`; `UnsafeRecord` for one that is not a header of the listed file) instead of read."""
    from merge_engine.formats.safetensors_file import SafetensorsFile, parse_header

    listed = {f.path: f for f in files}
    opened: list[SafetensorsFile] = []
    try:
        for filename in index.files:
            file_url = storage.join(url, filename)
            entry = listed.get(filename)
            header = None
            if headers is not None and entry is not None:
                try:
                    header = parse_header(file_url, entry.size, headers[filename])
                except (CorruptShard, IncompleteCheckpoint) as exc:
                    raise UnsafeRecord(f"carried safetensors header of {filename}: {exc.message}", url) from None
            reader = storage.RangeReader.listed(file_url, entry) if entry is not None else storage.RangeReader(file_url)
            opened.append(SafetensorsFile(file_url, reader, header))
    except Exception:
        for handle in opened:
            handle.close()
        raise
    return opened


def tensors_by_name(index: WeightIndex, opened: Sequence[SafetensorsFile]) -> dict[str, StoredTensor]:
    """Tensor name -> stored tensor; `CorruptShard` where the index and the headers disagree (a tensor
    the index puts in a file whose header lacks it, one stored where the index does not put it) or a
    tensor is stored twice."""
    tensors: dict[str, StoredTensor] = {}
    for handle, (filename, names) in zip(opened, index.files.items()):
        found = handle.tensors()
        missing = [n for n in names if n not in found]
        if missing:
            raise CorruptShard(f"index says {missing[0]!r} is here, the header disagrees", handle.url)
        if index.indexed:
            listed = set(names)
            unlisted = [n for n in found if n not in listed]
            if unlisted:
                raise CorruptShard(f"{unlisted[0]!r} is stored here but the index does not put it here", handle.url)
        for name, tensor in found.items():
            if name in tensors:
                raise CorruptShard(f"{name!r} is stored in two files", handle.url)
            tensors[name] = tensor
    return tensors


def source_of(url: str, opened: Sequence[SafetensorsFile], tensors: dict[str, StoredTensor]) -> TensorSource:
    """The folder's tensors as a `TensorSource` (closing it closes ``opened``)."""
    from merge_engine.formats.tensor_source import AssembledSource, ConcatTensor

    assembled = {name: ConcatTensor(t.shape, t.dtype_name, 0, (t,)) for name, t in tensors.items()}
    return AssembledSource(url, assembled, list(opened))


def _open_files(url: str, files: list[FileEntry], checkpoint: Checkpoint | None = None
                ) -> tuple[list[SafetensorsFile], dict[str, StoredTensor], WeightIndex]:
    """The folder's weight files opened, from the headers and index ``checkpoint`` carries when it carries them
    (`merge_engine.layouts.tensor_index.restore_headers`: nothing read), else from the files."""
    from merge_engine.layouts.tensor_index import restore_headers

    carried = restore_headers(checkpoint) if checkpoint is not None else None
    if carried is not None:
        index = WeightIndex({name: names or [] for name, names, _ in carried},
                            indexed=bool(carried) and all(names is not None for _, names, _ in carried))
        opened = open_weight_files(url, files, index, {name: header for name, _, header in carried})
    else:
        index = read_weight_index(url, files)
        opened = open_weight_files(url, files, index)
    try:
        return opened, tensors_by_name(index, opened), index
    except Exception:
        for handle in opened:
            handle.close()
        raise


def tensor_names(checkpoint: Checkpoint) -> set[str]:
    """The names of the tensors a checked folder holds, from its headers (carried by its check: no read, no torch)."""
    opened, tensors, _ = _open_files(checkpoint.url, list(checkpoint.files), checkpoint)
    for handle in opened:
        handle.close()
    return set(tensors)


def check_complete(url: str, files: list[FileEntry]) -> Checkpoint:
    """The weight files complete and their headers agreeing with the index; the headers and the index carried
    (`Checkpoint.index`: `open` reads neither again)."""
    from merge_engine.layouts.tensor_index import carry_headers

    opened, tensors, index = _open_files(url, files)
    for handle in opened:
        handle.close()
    carried = carry_headers([(name, names if index.indexed else None, handle.header.raw)
                             for (name, names), handle in zip(index.files.items(), opened)])
    entries = tuple(f for f in files if "/" not in f.path)
    return Checkpoint(url=url, layout=NAME, files=entries, parallel={}, hf_dir=url,
                      fingerprint=storage.fingerprint(entries), lora=holds_lora(tensors), index=carried)


def open(checkpoint: Checkpoint) -> TensorSource:  # noqa: A001 - the layout contract's verb
    opened, tensors, _ = _open_files(checkpoint.url, list(checkpoint.files), checkpoint)
    return source_of(checkpoint.url, opened, tensors)


LAYOUT = Layout(
    name=NAME,
    tensor_naming=TENSOR_NAMING,
    detect=detect,
    listing_verdict=listing_verdict,
    check_complete=check_complete,
    open=open,
)
