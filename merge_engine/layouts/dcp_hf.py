"""A state dict saved by ``torch.distributed.checkpoint`` through torch's ``HuggingFaceStorageWriter`` with
``save_distributed=True`` (torchtitan's and NeMo Automodel's "save in HF format"), not consolidated: each rank
writes ``shard-<rank+1>-model-<K>-of-<M>.safetensors`` (five digits each) holding its pieces of the tensors the
writer's ``fqn_to_index_mapping`` puts in output file K; each file's ``__metadata__`` holds
``DCP_SHARDING_INFO`` (JSON: tensor name -> ``{"saved_offsets": [...]}``, the piece's place in the full tensor).
With ``enable_consolidation`` the writer puts those files in ``sharded/`` and consolidates them into Hub files
beside it (without a config: no other layout reads the step); this layout reads ``sharded/``, written whole before
the consolidation starts, so a step is complete whether or not torch's consolidation has run.

Names are the state dict's as saved (Hub names when the trainer's adapter converted them; torchtitan's own names
are refused by name). A tensor's full shape is where its pieces end; its pieces must tile it exactly.

Complete, from a listing: one ``of-M`` for every file, output files 1..M and ranks 1..R (R the largest listed)
each present in some file, none empty. No file is written last (the writer writes no index when it does not
consolidate), so the check reads every header: a file shorter than its header says is still being written
(`IncompleteCheckpoint`). A rank not started yet at the end of the list cannot be seen in any name; the merge's
check of the tensors' shapes against ``config.json`` refuses such a step (`InvalidConfig`), it is never published.

Importing this module imports no torch: the readers are imported by `check_complete` and `open`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from merge_engine import storage
from merge_engine.errors import CorruptShard, IncompleteCheckpoint
from merge_engine.formats.hf_metadata import CONFIG_FILE
from merge_engine.layouts.contract import (
    ABSENT, DONE, HF_NAMES, INCOMPLETE, INVALID, Checkpoint, Layout, Verdict, holds_lora,
)
from merge_engine.storage import FileEntry

if TYPE_CHECKING:
    import torch

    from merge_engine.formats.dcp_index import ChunkInfo, DcpIndex, ItemLocation
    from merge_engine.formats.stored_tensor import StoredTensor
    from merge_engine.formats.tensor_source import TensorSource

NAME = "dcp_hf"
TENSOR_NAMING = HF_NAMES
SHARD_FILE = re.compile(r"^shard-([0-9]{5})-model-([0-9]{5})-of-([0-9]{5})\.safetensors$")
SHARDED_DIR = "sharded/"  # where the writer puts the rank files when it consolidates (torch's SHARDED_DIR_NAME)
SHARDING_INFO = "DCP_SHARDING_INFO"  # the __metadata__ key of each rank file (torch's CUSTOM_METADATA_KEY)
SAVED_OFFSETS = "saved_offsets"


def _shards(files: Sequence[FileEntry], folder: str) -> dict[str, tuple[int, int, int, FileEntry]]:
    """Rank files straight in ``folder``: name -> (rank index, output file, files in all, entry)."""
    found = {}
    for f in files:
        name = f.path[len(folder):]
        if f.path.startswith(folder) and "/" not in name:
            match = SHARD_FILE.match(name)
            if match:
                found[name] = (int(match.group(1)), int(match.group(2)), int(match.group(3)), f)
    return found


def _folder(files: Sequence[FileEntry]) -> str | None:
    """The folder holding the rank files: the top, else ``sharded/`` (whole before the writer consolidates)."""
    for folder in ("", SHARDED_DIR):
        if _shards(files, folder):
            return folder
    return None


def detect(files: Sequence[FileEntry]) -> bool:
    return _folder(files) is not None


def listing_verdict(files: Sequence[FileEntry]) -> Verdict:
    """See the module docstring: names and sizes only."""
    folder = _folder(files)
    if folder is None:
        return ABSENT
    shards = _shards(files, folder)
    totals = {total for _, _, total, _ in shards.values()}
    if len(totals) > 1:
        return Verdict(INVALID, f"rank files name several file counts {sorted(totals)}")
    (total,) = totals
    outputs = {k for _, k, _, _ in shards.values()}
    ranks = {r for r, _, _, _ in shards.values()}
    if min(ranks) < 1 or min(outputs) < 1 or max(outputs) > total:
        return Verdict(INVALID, f"rank files numbered outside 1..{total} or from 0")
    missing = sorted(set(range(1, total + 1)) - outputs)
    if missing:
        return Verdict(INCOMPLETE, f"no rank file of output file(s) {missing} of {total} yet")
    missing = sorted(set(range(1, max(ranks) + 1)) - ranks)
    if missing:
        return Verdict(INCOMPLETE, f"no file of rank(s) {missing} yet")
    empty = sorted(name for name, (_, _, _, f) in shards.items() if f.size == 0)
    if empty:
        return Verdict(INCOMPLETE, f"{empty[0]} is empty (still being written)")
    return DONE


def _offsets(metadata: dict[str, Any], name: str, shape: tuple[int, ...], url: str) -> tuple[int, ...]:
    try:
        info = json.loads(metadata[SHARDING_INFO])
        offsets = info[name][SAVED_OFFSETS]
    except (KeyError, TypeError, ValueError):
        raise CorruptShard(f"{name!r}: no {SAVED_OFFSETS} in the file's {SHARDING_INFO}", url) from None
    if not isinstance(offsets, list) or len(offsets) != len(shape) or not all(
            isinstance(o, int) and not isinstance(o, bool) and o >= 0 for o in offsets):
        raise CorruptShard(f"{name!r}: {SAVED_OFFSETS} {offsets!r} do not place a {list(shape)} piece", url)
    return tuple(offsets)


def read_index(folder_url: str, shards: dict[str, tuple[int, int, int, FileEntry]]) -> DcpIndex:
    """Every rank file's header read (`IncompleteCheckpoint` for one still being written) into one index:
    each tensor's pieces, placed by their saved offsets, tiling its full shape (else `CorruptShard`)."""
    from merge_engine.formats.dcp_index import ChunkInfo, DcpIndex, ItemLocation, TensorInfo, tiling_problem
    from merge_engine.formats.safetensors_file import read_header

    pieces: dict[str, list[ChunkInfo]] = {}
    dtypes: dict[str, str] = {}
    for name, (_, _, _, entry) in sorted(shards.items()):
        file_url = storage.join(folder_url, name)
        reader = storage.RangeReader.listed(file_url, entry)
        try:
            header = read_header(reader)
        finally:
            reader.close()
        for key, item in header.entries.items():
            if dtypes.setdefault(key, item.dtype_name) != item.dtype_name:
                raise CorruptShard(f"{key!r} is {item.dtype_name} here, {dtypes[key]} in another rank file", file_url)
            offsets = _offsets(header.metadata, key, item.shape, file_url)
            pieces.setdefault(key, []).append(ChunkInfo(offsets, item.shape,
                                                        ItemLocation(name, item.start, item.end - item.start)))
    tensors = {}
    for key, chunks in pieces.items():
        shape = tuple(max(c.offsets[d] + c.sizes[d] for c in chunks) for d in range(len(chunks[0].sizes)))
        problem = tiling_problem(shape, [(c.offsets, c.sizes) for c in chunks])
        if problem:
            raise CorruptShard(f"{key!r} {shape}: its saved {problem}", folder_url)
        tensors[key] = TensorInfo(shape, dtypes[key], tuple(chunks))
    return DcpIndex(folder_url, tensors, {})


def check_complete(url: str, files: list[FileEntry]) -> Checkpoint:
    """The listing's verdict complete, every rank file's header read and its pieces tiling each tensor; the index
    carried (`Checkpoint.index`: `open` reads no header again)."""
    from merge_engine.errors import UnsupportedLayout
    from merge_engine.layouts.dcp_model import TORCHTITAN_NAME
    from merge_engine.layouts.tensor_index import carry_dcp

    folder = _folder(files)
    if folder is None:
        raise IncompleteCheckpoint("no shard-*-model-*-of-*.safetensors files here", url)
    verdict = listing_verdict(files)
    if not verdict.complete:
        error = IncompleteCheckpoint if verdict.status == INCOMPLETE else CorruptShard
        raise error(verdict.reason, url)
    shards = _shards(files, folder)
    folder_url = storage.join(url, folder.rstrip("/")) if folder else url
    index = read_index(folder_url, shards)
    titan = next((n for n in index.tensors if TORCHTITAN_NAME.match(n)), None)
    if titan is not None:
        raise UnsupportedLayout(f"{NAME}: torchtitan's own parameter names (e.g. {titan!r}), not the Hub's", url)
    hf_dir = url if any(f.path == CONFIG_FILE for f in files) else None
    entries = tuple(sorted([f for *_, f in shards.values()] + (
        [f for f in files if "/" not in f.path and not SHARD_FILE.match(f.path)] if hf_dir else []),
        key=lambda f: f.path))
    ranks = {r for r, _, _, _ in shards.values()}
    return Checkpoint(url=url, layout=NAME, files=entries, parallel={"world_size": len(ranks)}, hf_dir=hf_dir,
                      fingerprint=storage.fingerprint(entries), notes=("HuggingFaceStorageWriter shards",),
                      lora=holds_lora(index.tensors), index=carry_dcp(index))


class _RankFiles:
    """The rank files as `merge_engine.formats.torch_dcp.DcpTensor` reads chunks (``chunk``): each piece a view
    on its byte range of the file (the index's location), opened on first use, no header read again."""

    def __init__(self, url: str, listed: dict[str, FileEntry]) -> None:
        self.url = url
        self._listed = listed
        self._readers: dict[str, storage.RangeReader] = {}
        self._starts: dict[str, int] = {}

    def chunk(self, location: ItemLocation, key: str, info: ChunkInfo, dtype: str) -> StoredTensor:
        from merge_engine.formats.stored_tensor import StorageRef, StoredTensor

        if location.file not in self._readers:
            entry = self._listed.get(location.file)
            if entry is None:
                raise CorruptShard("the index names a rank file the checkpoint does not list",
                                   storage.join(self.url, location.file))
            self._readers[location.file] = storage.RangeReader.listed(storage.join(self.url, location.file), entry)
        record = f"{location.file}@{location.offset}"
        self._starts[record] = location.offset
        stride, acc = [], 1
        for size in reversed(info.sizes):
            stride.append(acc)
            acc *= size
        return StoredTensor(_Item(self, location.file), StorageRef(record, dtype, acc), 0, tuple(info.sizes),
                            tuple(reversed(stride)))

    def read_into(self, file: str, record: str, element_offset: int, itemsize: int, out: torch.Tensor) -> None:
        import torch

        if out.numel():
            self._readers[file].read_into(self._starts[record] + element_offset * itemsize,
                                          out.reshape(-1).view(torch.uint8).numpy().data)

    def close(self) -> None:
        for reader in self._readers.values():
            reader.close()
        self._readers.clear()


class _Item:
    """The owner `StoredTensor` reads a piece through (``read_storage_into``): one rank file of `_RankFiles`."""

    def __init__(self, files: _RankFiles, file: str) -> None:
        self.files, self.file = files, file
        self.url = storage.join(files.url, file)

    def read_storage_into(self, storage_ref: Any, element_offset: int, out: torch.Tensor) -> None:
        self.files.read_into(self.file, storage_ref.key, element_offset, storage_ref.itemsize, out)


def open(checkpoint: Checkpoint) -> TensorSource:  # noqa: A001 - the layout contract's verb
    """The tensors, lazily, from the carried index (else every header read again)."""
    from merge_engine.formats.tensor_source import AssembledSource
    from merge_engine.formats.torch_dcp import DcpTensor
    from merge_engine.layouts.tensor_index import restore_dcp

    folder = _folder(checkpoint.files) or ""
    folder_url = storage.join(checkpoint.url, folder.rstrip("/")) if folder else checkpoint.url
    index = restore_dcp(checkpoint, folder)
    shards = _shards(checkpoint.files, folder)
    if index is None:
        index = read_index(folder_url, shards)
    files = _RankFiles(folder_url, {name: entry for name, (*_, entry) in shards.items()})
    tensors = {name: DcpTensor(name, info, files) for name, info in index.tensors.items()}  # type: ignore[arg-type]
    return AssembledSource(checkpoint.url, tensors, [files])


LAYOUT = Layout(
    name=NAME,
    tensor_naming=TENSOR_NAMING,
    detect=detect,
    listing_verdict=listing_verdict,
    check_complete=check_complete,
    open=open,
)
