"""Hugging Face model folders: ``config.json`` + ``model.safetensors`` or shards with an index.

Used for base models (LoRA fusion), references, and bridge exports (verl's Megatron bridge saves
the actor's weights straight into ``huggingface/``). Completeness: the index (when present) is
valid JSON, names only safe local files that all exist, and every tensor it maps is found in the
header of the file it names; every header parses. From a listing alone (`listing_verdict`, also for
the weights a training step saves in ``huggingface/`` or verl v2's ``model/huggingface/``): the index
present (transformers writes it after every shard) or a single non-empty ``model.safetensors``; in
``model/huggingface/`` verl v2's marker, written last.
"""

from __future__ import annotations

from collections.abc import Sequence

from merge_engine import storage
from merge_engine.errors import CorruptShard, IncompleteCheckpoint
from merge_engine.hf_metadata import CONFIG_FILE, INDEX_FILE, SINGLE_FILE
from merge_engine.json_file import read_json_object
from merge_engine.layouts import verl_v2
from merge_engine.layouts.contract import ABSENT, DONE, HF_NAMES, INCOMPLETE, Checkpoint, Verdict, by_path
from merge_engine.safetensors_file import SafetensorsFile
from merge_engine.storage import FileEntry
from merge_engine.tensor_source import AssembledSource, ConcatTensor, TensorSource

NAME = "hf"
TENSOR_NAMING = HF_NAMES
# where a training step keeps Hugging Face weights beside its own state (verl v2 first)
SAVED_BESIDE = (verl_v2.MODEL_HF_DIR, "huggingface/")


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


def weight_files(url: str, files: list[FileEntry]) -> dict[str, list[str]]:
    """Safetensors file -> tensor names it must hold (empty list: whatever its header says)."""
    top = {f.path: f for f in files if "/" not in f.path}
    if INDEX_FILE not in top:
        names = sorted(p for p in top if p.endswith(".safetensors"))
        if len(names) != 1:
            raise IncompleteCheckpoint(f"{len(names)} safetensors files and no {INDEX_FILE}", url)
        return {names[0]: []}
    index_url = storage.join(url, INDEX_FILE)
    weight_map = (read_json_object(index_url) or {}).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise CorruptShard(f"index has no weight_map object (found {type(weight_map).__name__})", index_url)
    expected: dict[str, list[str]] = {}
    for tensor, filename in weight_map.items():
        if not isinstance(filename, str) or "/" in filename or "\\" in filename or filename.startswith("."):
            raise CorruptShard(f"index maps {tensor!r} to an unsafe file name {filename!r}", index_url)
        expected.setdefault(filename, []).append(tensor)
    for filename in expected:
        if filename not in top:
            raise IncompleteCheckpoint(f"index names {filename}, which is missing", storage.join(url, filename))
        if top[filename].size == 0:
            raise IncompleteCheckpoint("weight file is empty", storage.join(url, filename))
    return expected


def _open_files(url: str, files: list[FileEntry]) -> tuple[list[SafetensorsFile], dict]:
    sizes = {f.path: f.size for f in files}
    opened, tensors = [], {}
    try:
        for filename, names in weight_files(url, files).items():
            file_url = storage.join(url, filename)
            handle = SafetensorsFile(file_url, storage.RangeReader(file_url, sizes.get(filename)))
            opened.append(handle)
            found = handle.tensors()
            missing = [n for n in names if n not in found]
            if missing:
                raise CorruptShard(f"index says {missing[0]!r} is here, the header disagrees", file_url)
            for name, tensor in found.items():
                if name in tensors:
                    raise CorruptShard(f"{name!r} is stored in two files", file_url)
                tensors[name] = tensor
    except Exception:
        for handle in opened:
            handle.close()
        raise
    return opened, tensors


def check_complete(url: str, files: list[FileEntry]) -> Checkpoint:
    opened, _ = _open_files(url, files)
    for handle in opened:
        handle.close()
    entries = tuple(f for f in files if "/" not in f.path)
    return Checkpoint(url=url, layout=NAME, files=entries, parallel={}, hf_dir=url,
                      fingerprint=storage.fingerprint(entries))


def open(checkpoint: Checkpoint) -> TensorSource:  # noqa: A001 - the layout contract's verb
    opened, tensors = _open_files(checkpoint.url, list(checkpoint.files))
    assembled = {name: ConcatTensor(t.shape, t.dtype, 0, (t,)) for name, t in tensors.items()}
    return AssembledSource(checkpoint.url, assembled, opened)
