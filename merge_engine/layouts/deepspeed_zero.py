"""DeepSpeed ZeRO stage 1, 2 and 3 checkpoints, as ``engine.save_checkpoint(save_dir, tag)`` writes them (HF
Trainer, TRL, OpenRLHF, verl's DeepSpeed backend): a tag folder (``global_stepN/``) holding

- stage 1/2: ``mp_rank_00_model_states.pt`` (rank 0: the module in its training dtype, buffers, ``param_shapes``)
  and ``[bf16_|fp16_]zero_pp_rank_R_mp_rank_00_optim_states.pt`` per data-parallel rank R (its partition of
  each parameter group's flat fp32 master vector, ``single_partition_of_fp32_groups``);
- stage 3: ``zero_pp_rank_R_mp_rank_00_model_states.pt`` and the optim file per rank (``fp32_flat_groups``:
  each parameter cut in ``ceil(numel / W)``-element slices, one per rank, the last padded).

The folder given may be the tag folder itself or a folder holding exactly one tag folder (HF Trainer's
``checkpoint-N/global_stepN/``, its ``config.json`` and tokenizer beside it: the Hugging Face folder of
the merge). ``latest`` names the newest tag; rank 0 writes it without waiting for the other ranks, so it is
never read as a sign of completeness.

Each parameter is rebuilt from the fp32 master partitions exactly as DeepSpeed's ``zero_to_fp32.py`` does
(stage 1/2: the ranks' partitions of a group concatenated, parameters in ``param_shapes`` order with the
recorded ``param_alignment_paddings``, the group padded to ``2 * W``; stage 3: each parameter's per-rank
slices concatenated and cut to its size), as lazy views on byte ranges of the optim files
(`merge_engine.formats.tensor_source.FlatTensor`): a merge reads each master byte once, tensor at a time.
Buffers come from rank 0's model file as stored; tied parameters (``shared_params``) are the same tensor.

Frozen parameters (a PEFT model's base under LoRA) have no fp32 master: they are read from the model states files
in the precision they were trained in, as ``zero_to_fp32.py`` reads them (stage 2: rank 0's
``frozen_param_fragments``); stage 3's per-rank fragments and stage 1's (recorded nowhere but the module) are
refused by name (`UnsupportedLayout`), not read yet.
A PEFT-wrapped model's names (``base_model.model.``, ``lora_A``/``lora_B``) make the checkpoint a LoRA one
(`Checkpoint.lora`): ``merge`` fuses it, ``extract-lora`` writes its adapter; one saved with
``exclude_frozen_parameters`` (HF Trainer's save of a PEFT model) holds the adapter only.

Refused by name (`UnsupportedLayout`): tensor or pipeline parallelism (``mp_rank_01``, ``layer_*`` files),
per-group partition counts that differ (expert parallelism), an optim file without a ZeRO stage (DeepSpeed's bf16
optimizer without ZeRO).

Completeness from a listing (`listing_verdict`): the model file(s), and for ranks 0..K every optim file (and at
stage 3 every model file) present and non-empty; a rank whose files are missing at the end of the range is only
seen by `check_complete`, which reads the world size DeepSpeed records (``partition_count``). This module imports
no torch: the readers are imported by `check_complete` and `open`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from merge_engine import storage
from merge_engine.errors import CorruptShard, IncompleteCheckpoint, UnsupportedLayout, WorldSizeMismatch
from merge_engine.formats.hf_metadata import CONFIG_FILE
from merge_engine.layouts.contract import (
    ABSENT, DONE, HF_NAMES, INCOMPLETE, INVALID, Checkpoint, Layout, StepLook, Verdict,
)
from merge_engine.storage import FileEntry

if TYPE_CHECKING:
    from merge_engine.formats.stored_tensor import StoredTensor
    from merge_engine.formats.tensor_source import TensorSource
    from merge_engine.formats.torch_archive import TorchArchive

NAME = "deepspeed_zero"
TENSOR_NAMING = HF_NAMES
MODEL_FILE = re.compile(r"^(?:zero_pp_rank_([0-9]+)_)?mp_rank_([0-9]+)_model_states\.pt$")
OPTIM_FILE = re.compile(r"^(?:(bf16|fp16)_)?zero_pp_rank_([0-9]+)_mp_rank_([0-9]+)_optim_states\.pt$")
OTHER_PARALLEL_FILE = re.compile(r"^(?:layer_[0-9]+|expp_rank_[0-9]+).*\.pt$")  # pipeline layers, expert-parallel state
OPTIMIZER_KEY = "optimizer_state_dict"
STAGE_1_2_GROUPS = "single_partition_of_fp32_groups"
STAGE_3_GROUPS = "fp32_flat_groups"
NEEDS_CONFIG = "hf_model_path"  # the merge parameter naming a config for a step saved without one
NEEDS_BASE = "base_model"  # the merge parameter naming the base of a step holding a LoRA adapter only
ADAPTER_CONFIG = "adapter_config.json"  # PEFT's, beside the tag when HF Trainer saves a PEFT model
ADAPTER_ONLY_REASON = ("a LoRA adapter only (HF Trainer's save of a PEFT model: base weights not saved, no "
                       f"config.json): a fused model needs {NEEDS_BASE} (--base-model), the model the run trained "
                       "from")


@dataclass(frozen=True)
class ZeroFiles:
    """The ZeRO files of one tag folder (``folder``: its path relative to the checkpoint URL, "" or ``tag/``):
    ``model`` by data-parallel rank (None: stage 1/2's one ``mp_rank_00_model_states.pt``), ``optim`` by rank."""

    folder: str
    model: dict[int | None, FileEntry]
    optim: dict[int, FileEntry]
    mp_ranks: frozenset[int]
    prefixes: frozenset[str]
    other_parallel: tuple[str, ...]

    @property
    def stage3_names(self) -> bool:
        return any(rank is not None for rank in self.model)


def _files_in(files: Sequence[FileEntry], folder: str) -> ZeroFiles:
    model: dict[int | None, FileEntry] = {}
    optim: dict[int, FileEntry] = {}
    mp_ranks: set[int] = set()
    prefixes: set[str] = set()
    other = []
    for entry in files:
        if not entry.path.startswith(folder) or "/" in entry.path[len(folder):]:
            continue
        name = entry.path[len(folder):]
        if match := MODEL_FILE.match(name):
            model[None if match.group(1) is None else int(match.group(1))] = entry
            mp_ranks.add(int(match.group(2)))
        elif match := OPTIM_FILE.match(name):
            optim[int(match.group(2))] = entry
            mp_ranks.add(int(match.group(3)))
            prefixes.add(match.group(1) or "")
        elif OTHER_PARALLEL_FILE.match(name):
            other.append(name)
    return ZeroFiles(folder, model, optim, frozenset(mp_ranks), frozenset(prefixes), tuple(other))


def _tag_folders(files: Sequence[FileEntry]) -> list[str]:
    """The folders ("" for the top, else ``tag/``) holding ZeRO model or optim files, top first."""
    found: set[str] = set()
    for entry in files:
        parts = entry.path.split("/")
        if len(parts) <= 2 and (MODEL_FILE.match(parts[-1]) or OPTIM_FILE.match(parts[-1])):
            found.add("" if len(parts) == 1 else parts[0] + "/")
    return sorted(found)


def detect(files: Sequence[FileEntry]) -> bool:
    return bool(_tag_folders(files))


def _problem(files: Sequence[FileEntry]) -> tuple[str, str, str, ZeroFiles | None]:
    """(status, reason, path at fault, the tag folder's files) of a listing: ``complete`` with its files, or why not."""
    folders = _tag_folders(files)
    if not folders:
        return "absent", "", "", None
    if len(folders) > 1:
        return INVALID, f"several DeepSpeed tag folders ({', '.join(folders)}): give the tag folder itself", "", None
    zero = _files_in(files, folders[0])
    if zero.mp_ranks - {0} or zero.other_parallel:
        what = zero.other_parallel[0] if zero.other_parallel else f"mp_rank_{max(zero.mp_ranks):02d}"
        return "unsupported", (f"{NAME}: DeepSpeed ZeRO with tensor, pipeline or expert parallelism ({what}) is not "
                               "supported: only data-parallel ZeRO (mp_rank_00) is read"), zero.folder, None
    if len(zero.prefixes) > 1:
        precisions = sorted(zero.prefixes)
        return INVALID, f"optim files of several precisions ({precisions}) in one tag folder", zero.folder, None
    if None in zero.model and len(zero.model) > 1:
        return INVALID, "both stage 1/2 and stage 3 model files in one tag folder", zero.folder, None
    if not zero.model:
        return INCOMPLETE, "no *model_states.pt written yet", zero.folder, None
    if not zero.optim:
        return INCOMPLETE, "no *_optim_states.pt written yet", zero.folder, None
    ranks = set(zero.optim) | {r for r in zero.model if r is not None}
    for kind, present in (("optim", set(zero.optim)), ("model", {r for r in zero.model if r is not None})):
        if kind == "model" and not zero.stage3_names:
            continue
        missing = sorted(set(range(max(ranks) + 1)) - present)
        if missing:
            return INCOMPLETE, f"{kind} files of ranks {missing} not written yet", zero.folder, None
    empty = sorted(e.path for e in (*zero.model.values(), *zero.optim.values()) if e.size == 0)
    if empty:
        return INCOMPLETE, f"{empty[0]} is empty (still being written)", empty[0], None
    return "complete", "", zero.folder, zero


def listing_verdict(files: Sequence[FileEntry]) -> Verdict:
    """See the module docstring: names and sizes only (an unsupported variant is ``invalid``, with the reason)."""
    status, reason, _, _ = _problem(files)
    if status == "absent":
        return ABSENT
    if status == "complete":
        return DONE
    return Verdict(INVALID if status == "unsupported" else status, reason)


def second_look(url: str, files: Sequence[FileEntry]) -> StepLook | None:
    """Discovery's look at a complete step of this layout (`Layout.second_look`; reads nothing) saved without
    ``config.json`` beside its tag folder: with PEFT's ``adapter_config.json`` there (HF Trainer's save of a PEFT
    model, ``exclude_frozen_parameters``: the adapter's masters only) it needs ``base_model``, the model the run
    trained from; else (a bare engine, OpenRLHF) ``hf_model_path``. None for a step with its config."""
    names = {f.path for f in files}
    if CONFIG_FILE in names or not listing_verdict(files).complete:
        return None
    if ADAPTER_CONFIG in names:
        return StepLook(NAME, Verdict(DONE.status, ADAPTER_ONLY_REASON), (NEEDS_BASE,))
    return StepLook(NAME, Verdict(DONE.status, "no config.json saved beside the DeepSpeed tag"), (NEEDS_CONFIG,))


def _zero_files(url: str, files: Sequence[FileEntry]) -> ZeroFiles:
    status, reason, where, zero = _problem(files)
    at = storage.join(url, where.rstrip("/")) if where else url
    if status == "absent":
        raise IncompleteCheckpoint("no DeepSpeed *model_states.pt or *_optim_states.pt file", url)
    if status == "unsupported":
        raise UnsupportedLayout(reason, at)
    if status == INVALID:
        raise CorruptShard(reason, at)
    if status == INCOMPLETE:
        raise IncompleteCheckpoint(reason, at)
    assert zero is not None
    return zero


def _optim_name(zero: ZeroFiles, rank: int) -> str:
    (prefix,) = zero.prefixes
    return f"{zero.folder}{prefix + '_' if prefix else ''}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"


def _stage(value: Any, url: str) -> int:
    """The ZeRO stage an optim file records: an int, or the pickled ``ZeroStageEnum`` record (its value)."""
    args = getattr(value, "args", None)
    if getattr(value, "qualname", "") == "ZeroStageEnum" and isinstance(args, tuple) and len(args) == 1:
        value = args[0]
    if type(value) is not int or value not in (1, 2, 3):
        raise CorruptShard(f"zero_stage is {value!r}, not 1, 2 or 3", url)
    return value


@dataclass
class _Opened:
    """The tag folder's archives, parsed: rank 0's model states, every optim file's optimizer state."""

    zero: ZeroFiles
    stage: int
    world_size: int
    model: dict[str, Any]
    optimizer: list[dict[str, Any]]
    archives: list[TorchArchive]


def _archive(url: str, entry: FileEntry) -> TorchArchive:
    from merge_engine.formats.torch_archive import TorchArchive

    file_url = storage.join(url, entry.path)
    return TorchArchive(file_url, storage.RangeReader.listed(file_url, entry))


def _tree(archive: TorchArchive, key: str) -> dict[str, Any]:
    tree = archive.load()
    value = tree.get(key) if isinstance(tree, dict) else None
    if not isinstance(value, dict):
        raise CorruptShard(f"no {key!r} dict: not a DeepSpeed checkpoint file", archive.url)
    return value


def _open(url: str, files: Sequence[FileEntry]) -> _Opened:
    zero = _zero_files(url, files)
    archives: list[TorchArchive] = []
    try:
        first = _archive(url, zero.optim[0])
        archives.append(first)
        optimizer0 = _tree(first, OPTIMIZER_KEY)
        if "zero_stage" not in optimizer0:
            raise UnsupportedLayout(f"{NAME}: an optim file without a ZeRO stage (DeepSpeed's bf16 optimizer "
                                    "without ZeRO, stage 0) is not supported", first.url)
        stage = _stage(optimizer0["zero_stage"], first.url)
        counts = optimizer0.get("partition_count")
        counts = counts if isinstance(counts, list) else [counts]
        if not counts or any(type(c) is not int or c < 1 for c in counts):
            raise CorruptShard(f"partition_count is {optimizer0.get('partition_count')!r}", first.url)
        if len(set(counts)) > 1:
            raise UnsupportedLayout(f"{NAME}: parameter groups partitioned over different rank counts "
                                    f"{sorted(set(counts))} (expert parallelism) are not supported", first.url)
        world_size = counts[0]
        extra = sorted(r for r in zero.optim if r >= world_size)
        if extra:
            raise WorldSizeMismatch(f"optim file of rank {extra[0]} beyond the {world_size} ranks DeepSpeed records",
                                    storage.join(url, zero.optim[extra[0]].path))
        for rank in range(world_size):
            if rank not in zero.optim:
                raise IncompleteCheckpoint(f"optim file of rank {rank} of {world_size} not written yet",
                                           storage.join(url, _optim_name(zero, rank)))
            if stage == 3 and rank not in zero.model:
                name = f"{zero.folder}zero_pp_rank_{rank}_mp_rank_00_model_states.pt"
                raise IncompleteCheckpoint(f"model file of rank {rank} of {world_size} not written yet",
                                           storage.join(url, name))
        if (stage == 3) != zero.stage3_names:
            raise CorruptShard(f"stage {stage} optim files beside model files named for stage "
                               f"{'3' if zero.stage3_names else '1/2'}", storage.join(url, zero.folder.rstrip("/")))
        optimizers = [optimizer0]
        for rank in range(1, world_size):
            archive = _archive(url, zero.optim[rank])
            archives.append(archive)
            optimizers.append(_tree(archive, OPTIMIZER_KEY))
        model_archive = _archive(url, zero.model[0 if stage == 3 else None])
        archives.append(model_archive)
        model = model_archive.load()
        if not isinstance(model, dict) or not isinstance(model.get("param_shapes"), list):
            raise CorruptShard("no param_shapes list: not a DeepSpeed model states file", model_archive.url)
        for rank in range(1, world_size) if stage == 3 else ():
            archive = _archive(url, zero.model[rank])  # every rank's model file readable (headers only)
            archives.append(archive)
            archive.load()
    except Exception:
        for archive in archives:
            archive.close()
        raise
    return _Opened(zero, stage, world_size, model, optimizers, archives)


def _flat_groups(opened: _Opened, rank: int) -> list[StoredTensor]:
    from merge_engine.formats.stored_tensor import StoredTensor

    key = STAGE_3_GROUPS if opened.stage == 3 else STAGE_1_2_GROUPS
    groups = opened.optimizer[rank].get(key)
    url = opened.archives[rank].url
    if not isinstance(groups, list) or not all(isinstance(g, StoredTensor) for g in groups):
        raise CorruptShard(f"no {key} list of tensors", url)
    for group in groups:
        if group.dtype_name != "float32" or len(group.shape) != 1 or not group.is_contiguous():
            raise CorruptShard(f"a {key} entry is {group.shape} {group.dtype_name}, not a flat fp32 vector", url)
    return groups


def _slice(piece: StoredTensor, start: int, count: int) -> StoredTensor:
    from merge_engine.formats.stored_tensor import StoredTensor

    return StoredTensor(piece.archive, piece.storage, piece.offset + start, (count,), (1,))


def _take(vectors: Sequence[StoredTensor], start: int, count: int) -> list[StoredTensor]:
    """Views of elements ``[start, start + count)`` of ``vectors`` concatenated (nothing read)."""
    out, at = [], 0
    for vector in vectors:
        n = vector.numel
        lo, hi = max(start, at), min(start + count, at + n)
        if lo < hi:
            out.append(_slice(vector, lo - at, hi - lo))
        at += n
    return out


def _shapes(opened: _Opened) -> list[dict[str, tuple[int, ...]]]:
    url = opened.archives[opened.world_size].url
    groups = []
    for group in opened.model["param_shapes"]:
        if not isinstance(group, dict):
            raise CorruptShard("a param_shapes entry is not a dict of names to shapes", url)
        groups.append(_checked_shapes(group, "param_shapes", url))
    return groups


def _frozen_shapes(opened: _Opened) -> dict[str, tuple[int, ...]]:
    """``frozen_param_shapes`` of rank 0's model states file (parameters outside the optimizer: a PEFT model's
    base), checked; empty when DeepSpeed recorded none (stage 1, or saved with ``exclude_frozen_parameters``)."""
    url = opened.archives[opened.world_size].url
    frozen = opened.model.get("frozen_param_shapes") or {}
    if not isinstance(frozen, dict):
        raise CorruptShard("frozen_param_shapes is not a dict of names to shapes", url)
    return _checked_shapes(frozen, "frozen_param_shapes", url)


def _checked_shapes(recorded: dict[Any, Any], field: str, url: str) -> dict[str, tuple[int, ...]]:
    """``recorded`` (a names-to-shapes dict of the model states file's ``field``) with every name a string and
    every shape a tuple of non-negative ints; else `CorruptShard` naming the entry."""
    shapes = {}
    for name, shape in recorded.items():
        if not isinstance(name, str) or not isinstance(shape, (tuple, list)) or \
                not all(type(d) is int and d >= 0 for d in shape):
            raise CorruptShard(f"{field} entry {name!r}: {shape!r} is not a shape", url)
        shapes[name] = tuple(shape)
    return shapes


def _fragments(opened: _Opened, archive: TorchArchive) -> dict[str, Any]:
    tree = archive.load()
    fragments = tree.get("frozen_param_fragments") if isinstance(tree, dict) else None
    if not isinstance(fragments, dict):
        raise CorruptShard("frozen_param_shapes without a frozen_param_fragments dict", archive.url)
    return fragments


def _frozen(opened: _Opened, trainable: dict[str, Any]) -> dict[str, Any]:
    """Every frozen parameter in the precision it was trained in (it has no fp32 master), as zero_to_fp32.py
    rebuilds it at stage 2: rank 0's whole ``frozen_param_fragments``. Refused by name (`UnsupportedLayout`):
    stage 3's (each rank's flat fragment), and stage 1's, which records none (parameters of rank 0's ``module``
    neither optimized, buffers nor tied names), not read yet."""
    from merge_engine.formats.stored_tensor import StoredTensor
    from merge_engine.formats.tensor_source import ConcatTensor

    model_archive = opened.archives[opened.world_size]
    url = model_archive.url
    shapes = _frozen_shapes(opened)
    tensors: dict[str, Any] = {}
    if not shapes and opened.stage < 3:
        module = opened.model.get("module")
        skip = set(trainable) | set(opened.model.get("buffer_names") or ()) | set(opened.model.get("shared_params")
                                                                                  or {})
        shapes = {name: tuple(value.shape) for name, value in (module.items() if isinstance(module, dict) else ())
                  if name not in skip and isinstance(name, str) and isinstance(value, StoredTensor)}
        if shapes:
            raise UnsupportedLayout(f"{NAME}: {len(shapes)} parameter(s) of the module outside the optimizer "
                                    f"(e.g. {next(iter(shapes))!r}) and no frozen_param_shapes (stage 1): frozen "
                                    "parameters are read at stage 2 only", url)
        return tensors
    if not shapes:
        return tensors
    if opened.stage == 3:
        raise UnsupportedLayout(f"{NAME}: {len(shapes)} frozen parameter(s) at stage 3 (e.g. "
                                f"{next(iter(shapes))!r}): their per-rank fragments are not read yet", url)
    fragments = _fragments(opened, model_archive)
    for name, shape in shapes.items():
        value = fragments.get(name)
        if not isinstance(value, StoredTensor) or tuple(value.shape) != shape:
            raise CorruptShard(f"frozen parameter {name!r}: its fragment is not a {shape} tensor", url)
        tensors[name] = ConcatTensor(value.shape, value.dtype_name, 0, (value,))
    return tensors


def _stage_1_2(opened: _Opened) -> dict[str, Any]:
    """Each parameter a view of its group's vector (the ranks' partitions concatenated), as zero_to_fp32.py reads it."""
    from merge_engine.formats.tensor_source import FlatTensor

    shapes = _shapes(opened)
    per_rank = [_flat_groups(opened, rank) for rank in range(opened.world_size)]
    url = opened.archives[0].url
    if any(len(groups) != len(shapes) for groups in per_rank):
        raise CorruptShard(f"{len(shapes)} parameter groups in param_shapes, optim files hold "
                           f"{sorted({len(g) for g in per_rank})}", url)
    paddings = opened.optimizer[0].get("param_alignment_paddings")
    tensors: dict[str, Any] = {}
    align = 2 * opened.world_size
    for index, group in enumerate(shapes):
        vectors = [groups[index] for groups in per_rank]
        available = sum(v.numel for v in vectors)
        pads = paddings[index] if isinstance(paddings, list) else None
        if pads is not None and (not isinstance(pads, list) or len(pads) != len(group)
                                 or not all(type(p) is int and p >= 0 for p in pads)):
            raise CorruptShard(f"param_alignment_paddings of group {index} do not match its {len(group)} parameters",
                               url)
        offset = 0
        for position, (name, shape) in enumerate(group.items()):
            numel = math.prod(shape)
            if offset + numel > available:
                raise CorruptShard(f"parameter {name!r} ends past group {index}'s {available} fp32 elements", url)
            tensors[name] = FlatTensor(shape, "float32", tuple(_take(vectors, offset, numel)))
            offset += numel + (pads[position] if pads is not None else 0)
        if align * math.ceil(offset / align) != align * math.ceil(available / align):
            raise CorruptShard(f"group {index}: parameters use {offset} of {available} fp32 elements", url)
    return tensors


def _stage_3(opened: _Opened) -> dict[str, Any]:
    """Each parameter's per-rank slices (``ceil(numel / W)`` elements at the same offset of every rank's groups)
    concatenated and cut to its size, as zero_to_fp32.py reads it."""
    from merge_engine.formats.tensor_source import FlatTensor

    shapes = {name: shape for group in _shapes(opened) for name, shape in group.items()}
    per_rank = [_flat_groups(opened, rank) for rank in range(opened.world_size)]
    sizes = [sum(v.numel for v in groups) for groups in per_rank]
    url = opened.archives[0].url
    if len(set(sizes)) > 1:
        raise CorruptShard(f"ranks hold different numbers of fp32 elements {sorted(set(sizes))}", url)
    world = opened.world_size
    tensors: dict[str, Any] = {}
    offset = 0
    for name, shape in shapes.items():
        numel = math.prod(shape)
        part = math.ceil(numel / world)
        if offset + part > sizes[0]:
            raise CorruptShard(f"parameter {name!r} ends past the {sizes[0]} fp32 elements of a rank", url)
        pieces = [piece for groups in per_rank for piece in _take(groups, offset, part)]
        tensors[name] = FlatTensor(shape, "float32", tuple(_take(pieces, 0, numel)))
        offset += part
    if offset != sizes[0]:
        raise CorruptShard(f"parameters use {offset} of the {sizes[0]} fp32 elements of a rank", url)
    return tensors


def _tensors(opened: _Opened) -> dict[str, Any]:
    """Every parameter (fp32 masters), buffer and tied name of the checkpoint, as lazy tensors."""
    from merge_engine.formats.stored_tensor import StoredTensor
    from merge_engine.formats.tensor_source import ConcatTensor

    tensors = _stage_3(opened) if opened.stage == 3 else _stage_1_2(opened)
    url = opened.archives[opened.world_size].url
    for name, tensor in _frozen(opened, tensors).items():
        if name in tensors:
            raise CorruptShard(f"parameter {name!r} is both frozen and in the optimizer's partitions", url)
        tensors[name] = tensor
    module = opened.model.get("module")
    buffers = opened.model.get("buffer_names") or []
    for name in buffers:
        value = module.get(name) if isinstance(module, dict) else None
        if not isinstance(name, str) or not isinstance(value, StoredTensor):
            raise CorruptShard(f"buffer {name!r} is not a tensor of the module", url)
        if name not in tensors:
            tensors[name] = ConcatTensor(value.shape, value.dtype_name, 0, (value,))
    shared = opened.model.get("shared_params") or {}
    if not isinstance(shared, dict):
        raise CorruptShard("shared_params is not a dict", url)
    for name, source in shared.items():
        if source in tensors and name not in tensors:
            tensors[name] = tensors[source]
    return tensors


def check_complete(url: str, files: list[FileEntry]) -> Checkpoint:
    """Every rank's model and optim file present, readable (headers) and agreeing with the world size and stage
    DeepSpeed records; every parameter rebuilt from the fp32 partitions (nothing read but the pickles)."""
    from merge_engine.layouts.contract import holds_lora
    from merge_engine.layouts.tensor_index import carry

    opened = _open(url, files)
    try:
        tensors = _tensors(opened)
    finally:
        for archive in opened.archives:
            archive.close()

    top = [f for f in files if "/" not in f.path]
    zero_entries = [*opened.zero.model.values(), *opened.zero.optim.values()]
    entries = tuple(sorted({*top, *zero_entries}, key=lambda f: f.path))
    hf_dir = url if any(f.path == CONFIG_FILE for f in top) else None
    return Checkpoint(url=url, layout=NAME, files=entries,
                      parallel={"world_size": opened.world_size, "zero_stage": opened.stage}, hf_dir=hf_dir,
                      fingerprint=storage.fingerprint(entries), lora=holds_lora(tensors),
                      index=carry(tensors, opened.archives),
                      notes=(f"DeepSpeed ZeRO stage {opened.stage}, {opened.world_size} ranks: fp32 master weights",))


def open(checkpoint: Checkpoint) -> TensorSource:  # noqa: A001 - the layout contract's verb
    """The fp32 master weights (and buffers) of every parameter, read lazily from the optim files' partitions: from
    the index the check carried (nothing read), else from the files' pickles."""
    from merge_engine.formats.tensor_source import AssembledSource
    from merge_engine.layouts.tensor_index import restore

    restored = restore(checkpoint)
    if restored is not None:
        tensors, archives = restored
        return AssembledSource(checkpoint.url, tensors, archives)

    opened = _open(checkpoint.url, list(checkpoint.files))
    try:
        tensors = _tensors(opened)
    except Exception:
        for archive in opened.archives:
            archive.close()
        raise
    return AssembledSource(checkpoint.url, tensors, opened.archives)


LAYOUT = Layout(
    name=NAME,
    tensor_naming=TENSOR_NAMING,
    detect=detect,
    listing_verdict=listing_verdict,
    check_complete=check_complete,
    open=open,
    second_look=second_look,
)
