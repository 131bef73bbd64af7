"""verl FSDP checkpoints: ``model_world_size_{W}_rank_{R}.pt`` per rank, plus ``fsdp_config.json``.

Each rank file is a ``torch.save`` of that rank's state dict. A value is one of:
- a DTensor (FSDP2, or FSDP1 with a device mesh, or FSDP2 over tensor parallelism on a
  ``(dp_shard, tp)`` mesh): its placements decide, whatever the mesh dims are called. Each rank's
  block (offset and shape in the global tensor) is what torch computes for its placements
  (``Shard``, ``_StridedShard``, ``Replicate``, on any number of mesh dims) and mesh coordinate;
  uneven and empty blocks included; ranks holding the same block are replicas (HSDP, parameters
  replicated over ``tp``), read once. Blocks tile the tensor along one dim, or along dim 0 and one
  other (FSDP rows x TP columns); ``Partial`` is refused;
- a ShardedTensor (FSDP1 without a mesh): local shards with offsets into the global tensor;
- a plain tensor (buffers, world size 1): identical on every rank, checked, taken once.

Completeness (`check_complete`, a hand merge): the world size from the file names must be unique
and agree with ``fsdp_config.json`` (which rank 0 writes *before* the final barrier, so it proves
nothing about the other ranks); every rank file present, non-empty and a readable torch archive.
The watcher's rule (`listing_verdict`) is stricter: see there.

How each key's per-rank values become one full tensor: `merge_engine.layouts.fsdp_tensors`. This
module imports no torch: the registry (and a listings-only watcher) reads names and sizes only; the
readers are imported by `check_complete` and `open`.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from merge_engine import storage
from merge_engine.errors import CorruptShard, IncompleteCheckpoint, WorldSizeMismatch
from merge_engine.layouts.contract import (
    ABSENT, DONE, HF_NAMES, INCOMPLETE, INVALID, Checkpoint, Layout, Verdict, holds_lora,
)
from merge_engine.formats.json_file import read_json_object
from merge_engine.storage import FileEntry

if TYPE_CHECKING:  # the readers import torch: imported when a checkpoint is checked or opened, not with the registry
    from merge_engine.formats.tensor_source import TensorSource
    from merge_engine.formats.torch_archive import TorchArchive

NAME = "fsdp"
TENSOR_NAMING = HF_NAMES
MODEL_FILE = re.compile(r"^model_world_size_([0-9]+)_rank_([0-9]+)\.pt$")
RANK_FILE = re.compile(r"^(model|optim|extra_state)_world_size_([0-9]+)_rank_([0-9]+)\.pt$")  # every per-rank kind
CONFIG_FILE = "fsdp_config.json"
FSDP_VERSIONS = (1, 2)
HF_DIR = "huggingface"
LORA_ADAPTER_DIR = "lora_adapter"  # older verl LoRA runs: adapter_config.json (lora_alpha) lives here
# wrapper prefixes FSDP / activation checkpointing / torch.compile may leave in key names
WRAPPER_PREFIXES = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")


def model_files(files: Sequence[FileEntry]) -> dict[int, dict[int, FileEntry]]:
    """Top-level rank files grouped as world size -> rank -> entry."""
    found: dict[int, dict[int, FileEntry]] = defaultdict(dict)
    for entry in files:
        match = MODEL_FILE.match(entry.path)
        if match:
            found[int(match.group(1))][int(match.group(2))] = entry
    return dict(found)


def detect(files: Sequence[FileEntry]) -> bool:
    return bool(model_files(files))


def listing_verdict(files: Iterable[FileEntry], config_world_size: int | None = None) -> Verdict:
    """Is a verl FSDP folder complete, judging by its listing alone (paths relative to the folder)?

    Not a checkpoint when no rank file and no ``fsdp_config.json`` is listed. Complete when: every
    ``model_world_size_W_rank_R.pt`` for R in 0..W-1 is present and non-empty, all rank files name
    one world size W (and it equals ``config_world_size`` when the caller read ``fsdp_config.json``),
    ``fsdp_config.json`` is present, and each other per-rank kind that exists (optim, extra_state)
    exists for every rank and is non-empty. Why the last rule: each rank writes model, then optim,
    then extra_state, and rank 0 writes ``fsdp_config.json`` BEFORE the final barrier, so the config
    alone does not prove the other ranks are done; a rank's later file does. This cannot see a file
    that is non-empty but still growing on a local disk: `check_complete` (zip readable) covers that.
    """
    kinds: dict[str, dict[int, FileEntry]] = defaultdict(dict)
    world_sizes: dict[str, set[int]] = defaultdict(set)
    has_config = False
    for entry in files:
        if entry.path == CONFIG_FILE:
            has_config = True
            continue
        match = RANK_FILE.match(entry.path)
        if match:
            kind, world, rank = match.group(1), int(match.group(2)), int(match.group(3))
            world_sizes[kind].add(world)
            kinds[kind][rank] = entry
    if not has_config and not kinds:
        return ABSENT
    all_sizes = set().union(*world_sizes.values()) if world_sizes else set()
    if len(all_sizes) > 1:
        return Verdict(INVALID, f"rank files name several world sizes {sorted(all_sizes)}")
    if not kinds.get("model"):
        return Verdict(INCOMPLETE, "no model_world_size_*_rank_*.pt file yet")
    (world,) = all_sizes
    if config_world_size is not None and config_world_size != world:
        return Verdict(INVALID, f"file names say world size {world}, {CONFIG_FILE} says {config_world_size}")
    for kind in ("model", "optim", "extra_state"):
        ranks = kinds.get(kind)
        if not ranks:
            continue
        beyond = sorted(r for r in ranks if r >= world)
        if beyond:
            return Verdict(INVALID, f"{kind} rank files {beyond} are beyond world size {world}")
        missing = sorted(set(range(world)) - set(ranks))
        if missing:
            return Verdict(INCOMPLETE, f"{kind} files for ranks {missing} of {world} not written yet")
        empty = sorted(r for r, e in ranks.items() if e.size == 0)
        if empty:
            return Verdict(INCOMPLETE, f"{kind} files for ranks {empty} are empty (still being written)")
    if not has_config:
        return Verdict(INCOMPLETE, f"{CONFIG_FILE} not written yet")
    return DONE


def fsdp_config(url: str) -> dict[str, int]:
    """``fsdp_config.json`` checked: ``world_size`` a positive integer, ``FSDP_version`` (if any) 1 or 2.

    `CorruptShard` naming the file for anything else (not JSON, nested too deep, ``"two"``, ...)."""
    config_url = storage.join(url, CONFIG_FILE)
    config = read_json_object(config_url) or {}
    world_size, version = config.get("world_size"), config.get("FSDP_version")
    if type(world_size) is not int or world_size < 1:
        raise CorruptShard(f"world_size is {world_size!r}, not a positive integer", config_url)
    if version is not None and (type(version) is not int or version not in FSDP_VERSIONS):
        raise CorruptShard(f"FSDP_version is {version!r}; verl writes one of {list(FSDP_VERSIONS)}", config_url)
    return {"world_size": world_size, **({"FSDP_version": version} if version is not None else {})}


def world_size_of(url: str, files: list[FileEntry]) -> tuple[int, dict[str, int] | None]:
    """The world size all evidence agrees on, and ``fsdp_config.json`` as read for it (None: not listed);
    raises `WorldSizeMismatch` / `IncompleteCheckpoint`."""
    by_size = model_files(files)
    if len(by_size) > 1:
        raise WorldSizeMismatch(f"rank files of several world sizes {sorted(by_size)} in one folder", url)
    (world_size, ranks), = by_size.items()
    entries = {e.path: e for e in files}
    config = fsdp_config(url) if CONFIG_FILE in entries else None
    if config is not None:
        recorded = config["world_size"]
        if recorded != world_size:
            raise WorldSizeMismatch(
                f"file names say world size {world_size}, {CONFIG_FILE} says {recorded}", storage.join(url, CONFIG_FILE))
    missing = sorted(set(range(world_size)) - set(ranks))
    if missing:
        name = f"model_world_size_{world_size}_rank_{missing[0]}.pt"
        raise IncompleteCheckpoint(f"{len(missing)} of {world_size} rank files missing (ranks {missing})",
                                   storage.join(url, name))
    extra = sorted(set(ranks) - set(range(world_size)))
    if extra:
        raise WorldSizeMismatch(f"rank {extra[0]} is outside world size {world_size}", url)
    for rank in range(world_size):
        if ranks[rank].size == 0:
            raise IncompleteCheckpoint("rank file is empty (0 bytes)", storage.join(url, ranks[rank].path))
    return world_size, config


def check_complete(url: str, files: list[FileEntry]) -> Checkpoint:
    """Every rank file present, non-empty, a readable torch archive with the same keys, each key's
    pieces assembling into one tensor; the assembled index carried (`merge_engine.layouts.tensor_index`)."""
    from merge_engine.layouts.tensor_index import carry

    world_size, config = world_size_of(url, files)  # fsdp_config.json read once
    archives = _open_archives(url, files, world_size)
    try:
        key_sets = [set(state_dict(a)) for a in archives]
        for rank, keys in enumerate(key_sets[1:], start=1):
            if keys != key_sets[0]:
                diff = sorted(keys ^ key_sets[0])[:3]
                raise CorruptShard(f"rank {rank} holds different tensors than rank 0 (e.g. {diff})", archives[rank].url)
        tensors = _assembled(url, archives)
    finally:
        for archive in archives:
            archive.close()
    # everything the merge reads decides its fingerprint: rank files, configs, huggingface/, lora_adapter/
    entries = tuple(e for e in files if "/" not in e.path or e.path.split("/")[0] in (HF_DIR, LORA_ADAPTER_DIR))
    hf_dir = storage.join(url, HF_DIR) if any(e.path.startswith(HF_DIR + "/") for e in files) else None
    parallel = {"world_size": world_size}
    if config is not None and config.get("FSDP_version") is not None:
        parallel["fsdp_version"] = config["FSDP_version"]
    return Checkpoint(url=url, layout=NAME, files=entries, parallel=parallel, hf_dir=hf_dir,
                      fingerprint=storage.fingerprint(entries), lora=holds_lora(tensors),
                      index=carry(tensors, archives))


def state_dict(archive: TorchArchive) -> dict[str, Any]:
    """A rank file's object tree, which must be what ``model.state_dict()`` saves: a dict of tensor names
    (strings). Anything else (a list, a bare tensor, an int, a dict keyed by numbers) is `CorruptShard`
    naming the rank file, in ``check`` and ``merge`` alike."""
    tree = archive.load()
    if not isinstance(tree, dict):
        kind = "a tensor" if type(tree).__name__ == "StoredTensor" else f"a {type(tree).__name__}"
        raise CorruptShard(f"the rank file's pickle is {kind}, not a state dict (tensor names -> tensors)",
                           archive.url)
    bad = next((k for k in tree if not isinstance(k, str)), None)
    if bad is not None:
        raise CorruptShard(f"the rank file's state dict has a key {bad!r} of type {type(bad).__name__}: "
                           "tensor names are strings", archive.url)
    return tree


def _open_archives(url: str, files: list[FileEntry], world_size: int) -> list[TorchArchive]:
    from merge_engine.formats.torch_archive import TorchArchive

    ranks = model_files(files)[world_size]
    archives = []
    try:
        for rank in range(world_size):
            entry = ranks[rank]
            file_url = storage.join(url, entry.path)
            archive = TorchArchive(file_url, storage.RangeReader.listed(file_url, entry))
            archives.append(archive)
            state_dict(archive)
    except Exception:
        for archive in archives:
            archive.close()
        raise
    return archives


def clean_name(name: str) -> str:
    for prefix in WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def _assembled(url: str, archives: list[TorchArchive]) -> dict[str, Any]:
    """Every key of the loaded rank files assembled across ranks into its full lazy tensor (cleaned names)."""
    from merge_engine.layouts.fsdp_tensors import assemble

    trees = [state_dict(a) for a in archives]
    tensors = {}
    for key in trees[0]:
        values = [tree[key] for tree in trees]
        name = clean_name(key)
        if name in tensors:
            raise CorruptShard(f"two keys clean to the same name {name!r}", url)
        tensors[name] = assemble(key, values, archives)
    return tensors


def open(checkpoint: Checkpoint) -> TensorSource:  # noqa: A001 - the layout contract's verb
    """The full-tensor view of every key: from the index the check carried (nothing read), else from
    the rank files' headers."""
    from merge_engine.layouts.tensor_index import restore
    from merge_engine.formats.tensor_source import AssembledSource

    restored = restore(checkpoint)
    if restored is not None:
        tensors, archives = restored
        return AssembledSource(checkpoint.url, tensors, archives)
    world_size = checkpoint.parallel["world_size"]
    archives = _open_archives(checkpoint.url, list(checkpoint.files), world_size)
    try:
        tensors = _assembled(checkpoint.url, archives)
    except Exception:
        for archive in archives:
            archive.close()
        raise
    return AssembledSource(checkpoint.url, tensors, archives)


LAYOUT = Layout(
    name=NAME,
    tensor_naming=TENSOR_NAMING,
    detect=detect,
    listing_verdict=listing_verdict,
    check_complete=check_complete,
    open=open,
)
