"""Megatron per-rank checkpoints: verl's legacy ``model/mp_rank_*/model.pt`` and Megatron-LM's
``iter_N/mp_rank_*/model_optim_rng.pt``.

Files (``TT`` tensor-parallel rank, ``PPP`` pipeline stage when PP > 1, ``EEE`` expert-parallel
rank when EP > 1 — Megatron adds a suffix only for a size above 1):

- verl:        ``<actor>/model/mp_rank_TT[_PPP][_EEE]/model.pt`` = a list of state dicts, one per
               virtual-pipeline (VPP) chunk; config + tokenizer in ``hf_config_and_tokenizer/``
               (or ``huggingface/``) beside ``model/``.
- Megatron-LM: ``iter_NNNNNNN/mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt`` = {``args``, ``model`` or
               ``model0``, ``model1``, ... under VPP, ...}; a run root is accepted too (the iteration
               comes from ``latest_checkpointed_iteration.txt``). No config: pass ``--hf-model-path``.

Layer numbers restart at 0 in every chunk; chunk v of stage p holds the layers after those of the
chunks before it in (v, p) order. Expert numbers restart in every EP rank. Names may be local-spec
or TransformerEngine-style. `open` gives the *canonical* Megatron tensors (see
`merge_engine.architectures.megatron_names`), each gathered lazily from its TP pieces by the rules
of `merge_engine.architectures.parallel` — nothing is read until the writer asks. Tensors repeated
on every EP rank (everything but the experts) are read from EP rank 0; TP copies of replicated
tensors (also a critic's one-row value head) are checked identical while read.

Completeness: one kind of rank file; every (tp, pp, ep) cell the names span present, non-empty and
a readable archive; the same number of VPP chunks everywhere; the same keys on every TP rank of a
stage; a stage holding the final norm; Megatron-LM ``args`` agreeing with the folders.

Importing this module imports no torch (the registry and discovery read names and sizes only): the
archive reader, lazy tensors and TP rules are imported by the functions that open or write files.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from merge_engine import storage
from merge_engine.architectures.megatron_names import (
    EXPERT_NAME,
    EXTRA_STATE_MODULES,
    LAYER_NAME,
    MTP_TRANSFORMER_LAYER,
    canonical_layer_name,
    expert_name,
    is_extra_state,
    layer_name,
    order_key,
)
from merge_engine.errors import CorruptShard, IncompleteCheckpoint, UnsupportedLayout, WorldSizeMismatch
from merge_engine.layouts.contract import (
    ABSENT,
    DONE,
    INCOMPLETE,
    INVALID,
    MEGATRON_NAMES,
    Checkpoint,
    FileJob,
    Layout,
    ParallelSizes,
    Verdict,
    Writer,
    holds_lora,
)
from merge_engine.storage.written import FileRecord, WriteCancelled
from merge_engine.layouts.megatron_lm_root import choose_iteration
from merge_engine.storage import FileEntry
from merge_engine.storage.hashing_writer import HashingWriter

if TYPE_CHECKING:  # readers, lazy tensors, TP rules: they import torch
    import torch

    from merge_engine.architectures.hf_to_megatron import MegatronViewOfHf
    from merge_engine.architectures.parallel import TPKind
    from merge_engine.formats.tensor_source import TensorSource
    from merge_engine.formats.stored_tensor import StoredTensor
    from merge_engine.formats.torch_archive import TorchArchive

NAME = "megatron_legacy"
TENSOR_NAMING = MEGATRON_NAMES
CONFIG_DIR = "hf_config_and_tokenizer"  # where `write`'s caller puts config.json + tokenizer
RANK_FILE = re.compile(r"^(?P<prefix>(?:model/|iter_[0-9]+/)?)mp_rank_(?P<tp>[0-9]{2})(?P<rest>(?:_[0-9]{3}){0,2})/"
                       r"(?P<file>model\.pt|model_optim_rng\.pt)$")
VERL_FILE, MEGATRON_LM_FILE = "model.pt", "model_optim_rng.pt"
HF_DIRS = ("hf_config_and_tokenizer", "huggingface")
FINAL_NORM = "decoder.final_layernorm.weight"
MTP_EMBEDDING = "mtp.embedding.word_embeddings.weight"  # the MTP stage's embedding copy (PP > 1)
EMBEDDING = "embedding.word_embeddings.weight"


@dataclass(frozen=True)
class RankGrid:
    """The parallel sizes and where each (tp, pp, ep) rank file is (paths relative to the root)."""

    tp: int
    pp: int
    ep: int
    vpp: int
    files: dict[tuple[int, int, int], FileEntry]
    kind: str  # VERL_FILE or MEGATRON_LM_FILE


def detect(files: Sequence[FileEntry]) -> bool:
    return any(RANK_FILE.match(f.path) for f in files)


# every file of a rank folder (Megatron-LM also keeps e.g. distrib_optim.pt there): each must be non-empty
ANY_RANK_FILE = re.compile(r"^(?:model/|iter_[0-9]+/)?mp_rank_([0-9]{2})((?:_[0-9]{3}){0,2})/[^/]+\.pt$")


def listing_verdict(files: Sequence[FileEntry]) -> Verdict:
    """Per-rank ``mp_rank_TT[_PPP][_EEE]/*.pt`` folders: every cell of the (tp, pp, ep) grid the names
    span is present and non-empty. The highest ranks of a grid still being written are invisible from
    names alone; `check_complete` checks the parallel sizes it reads from the checkpoint."""
    if not detect(files):
        return ABSENT
    cells: dict[tuple[int, ...], list[FileEntry]] = defaultdict(list)
    for entry in files:
        match = RANK_FILE.match(entry.path)
        if match:
            cells[(int(match.group("tp")),) + tuple(int(x) for x in match.group("rest").split("_") if x)].append(entry)
    dims = {len(c) for c in cells}
    if len(dims) > 1:
        return Verdict(INVALID, "mp_rank_* folder names mix parallel dimensions")
    ndim = dims.pop()
    spans = [max(c[i] for c in cells) + 1 for i in range(ndim)]
    grid: list[tuple[int, ...]] = [()]
    for span in spans:
        grid = [g + (i,) for g in grid for i in range(span)]
    missing = [g for g in grid if g not in cells]
    if missing:
        return Verdict(INCOMPLETE, f"{len(missing)} mp_rank folders of {len(grid)} not written yet")
    empty = sorted(e.path for e in files if ANY_RANK_FILE.match(e.path) and e.size == 0)
    if empty:
        return Verdict(INCOMPLETE, f"empty (still being written): {empty[:3]}")
    return DONE


def _choose_root(url: str, files: list[FileEntry]) -> tuple[str, list[FileEntry]]:
    """A Megatron-LM run root -> its iteration folder (from the tracker, or the only one); else ``url`` itself."""
    prefixes = {m.group("prefix") for f in files if (m := RANK_FILE.match(f.path))}
    iterations = {p.rstrip("/") for p in prefixes if p.startswith("iter_")}
    if not iterations:
        return url, files
    if len(prefixes) > len(iterations):
        raise UnsupportedLayout("rank folders both at the top and inside iter_* folders", url)
    return choose_iteration(url, files, iterations, holds="rank files")


Opened = dict[str, "TorchArchive"]  # rank file path -> its archive, opened and parsed once per check or open


def _open_archive(url: str, entry: FileEntry, opened: Opened) -> TorchArchive:
    """The archive of ``entry``, opened once into ``opened`` (which the caller closes)."""
    from merge_engine.formats.torch_archive import TorchArchive

    archive = opened.get(entry.path)
    if archive is None:
        file_url = storage.join(url, entry.path)
        if entry.size == 0:
            raise IncompleteCheckpoint("rank file is empty (0 bytes)", file_url)
        archive = opened[entry.path] = TorchArchive(file_url, storage.RangeReader.listed(file_url, entry))
    return archive


def _close_all(opened: Opened) -> None:
    for archive in opened.values():
        archive.close()


def chunk_states(tree: Any, archive: TorchArchive) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """A rank file's object tree -> (one state dict per VPP chunk, Megatron-LM ``args`` fields or {})."""
    from merge_engine.formats.safe_unpickler import Record

    if isinstance(tree, list):
        states = tree
        args: dict[str, Any] = {}
    elif isinstance(tree, dict) and ("model" in tree or "model0" in tree):
        if "model" in tree:
            states = [tree["model"]]
        else:
            states = []
            while f"model{len(states)}" in tree:
                states.append(tree[f"model{len(states)}"])
        args = tree["args"].fields if isinstance(tree.get("args"), Record) else {}
    elif isinstance(tree, dict) and all(isinstance(k, str) for k in tree):
        states, args = [tree], {}
    else:
        raise CorruptShard(f"rank file holds a {type(tree).__name__}, not Megatron state dicts", archive.url)
    if not states or not all(isinstance(s, dict) for s in states):
        raise CorruptShard("rank file holds no model state dict", archive.url)
    bad = next((k for s in states for k in s if not isinstance(k, str)), None)
    if bad is not None:
        raise CorruptShard(f"a state dict of the rank file has a key {bad!r} of type {type(bad).__name__}: "
                           "tensor names are strings", archive.url)
    return states, args


def _grid(url: str, files: list[FileEntry], opened: Opened) -> RankGrid:
    """Parallel sizes from the folder names (+ Megatron-LM args), every cell checked present. The rank
    files it parses (TP rank 0's, maybe one more) stay in ``opened`` for the caller to reuse."""
    cells: dict[tuple[int, ...], FileEntry] = {}
    kinds, prefixes = set(), set()
    for entry in files:
        match = RANK_FILE.match(entry.path)
        if match:
            coords = (int(match.group("tp")),) + tuple(int(x) for x in match.group("rest").split("_") if x)
            kinds.add(match.group("file"))
            prefixes.add(match.group("prefix"))
            cells[coords] = entry
    if not cells:
        raise IncompleteCheckpoint("no mp_rank_*/model.pt or model_optim_rng.pt file here", url)
    if len(kinds) > 1 or len(prefixes) > 1:
        raise UnsupportedLayout(f"mixed rank files here ({', '.join(sorted(kinds))}); one checkpoint per folder", url)
    (kind,) = kinds
    dims = {len(c) for c in cells}
    if len(dims) > 1:
        raise WorldSizeMismatch("mp_rank_* folder names mix parallel dimensions "
                                f"(e.g. {min(cells)} and {max(cells)})", url)
    ndim = dims.pop()
    spans = [max(c[i] for c in cells) + 1 for i in range(ndim)]
    prefix = prefixes.pop()
    first = _open_archive(url, cells[(0,) * ndim], opened) if (0,) * ndim in cells else None
    if first is None:
        raise IncompleteCheckpoint("rank folder of TP rank 0 missing", storage.join(url, prefix + _folder((0,) * ndim)))
    states, args = chunk_states(first.load(), first)
    tp, rest = spans[0], spans[1:]
    if ndim == 1:
        pp, ep = 1, 1
    elif ndim == 3:
        pp, ep = rest
    else:
        if rest[0] == 1:
            raise IncompleteCheckpoint(f"only {_folder((0, 0))}-style folders: the suffix says PP or EP > 1, "
                                       "but no second stage or expert rank is here", url)
        if args:
            stage_axis = _arg_size(args, "pipeline_model_parallel_size", first.url) > 1
        else:
            stage_axis = not _holds_embedding(url, cells.get((0, 1)), opened)
        pp, ep = (rest[0], 1) if stage_axis else (1, rest[0])
    vpp = len(states)
    if args:
        recorded = {"tp": args.get("tensor_model_parallel_size"), "pp": args.get("pipeline_model_parallel_size"),
                    "ep": args.get("expert_model_parallel_size"), "vpp": args.get("virtual_pipeline_model_parallel_size")}
        found = {"tp": tp, "pp": pp, "ep": ep, "vpp": vpp}
        for key, value in recorded.items():
            if value is not None and _arg_size(args, _ARG_NAMES[key], first.url) != found[key]:
                raise WorldSizeMismatch(f"the checkpoint's args say {key}={value}, the rank folders give {key}="
                                        f"{found[key]}", storage.join(url, prefix + _folder((0,) * ndim)))
    grid: dict[tuple[int, int, int], FileEntry] = {}
    for t in range(tp):
        for p in range(pp):
            for e in range(ep):
                coords = (t,) + ((p, e) if ndim == 3 else (p,) if pp > 1 else (e,) if ndim == 2 else ())
                cell = cells.get(coords)
                if cell is None:
                    raise IncompleteCheckpoint(f"rank folder missing (TP={tp}, PP={pp}, EP={ep})",
                                               storage.join(url, prefix + _folder(coords)))
                if cell.size == 0:
                    raise IncompleteCheckpoint("rank file is empty (0 bytes)", storage.join(url, cell.path))
                grid[(t, p, e)] = cell
    return RankGrid(tp, pp, ep, vpp, grid, kind)


_ARG_NAMES = {"tp": "tensor_model_parallel_size", "pp": "pipeline_model_parallel_size",
              "ep": "expert_model_parallel_size", "vpp": "virtual_pipeline_model_parallel_size"}


def _arg_size(args: dict[str, Any], name: str, url: str) -> int:
    """A parallel size from Megatron-LM's pickled ``args``: a positive integer (None or 0: 1), else
    `CorruptShard` naming the rank file — the args come from the file, so they may say anything."""
    value = args.get(name)
    if value is None or value == 0:
        return 1
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise CorruptShard(f"the checkpoint's args give {name}={value!r}, not a parallel size", url)
    return value


def _folder(coords: tuple[int, ...]) -> str:
    return f"mp_rank_{coords[0]:02d}" + "".join(f"_{c:03d}" for c in coords[1:])


def _holds_embedding(url: str, entry: FileEntry | None, opened: Opened) -> bool:
    if entry is None:
        return False
    archive = _open_archive(url, entry, opened)
    states, _ = chunk_states(archive.load(), archive)
    return any(k.endswith(EMBEDDING) for k in states[0])


def _hf_dir(url: str, files: list[FileEntry], prefix: str) -> str | None:
    if prefix.startswith("iter_"):
        return None
    for folder in HF_DIRS:
        if any(f.path == f"{folder}/config.json" for f in files):
            return storage.join(url, folder)
    return None


def check_complete(url: str, files: list[FileEntry]) -> Checkpoint:
    """Every rank file present, non-empty and readable (each parsed once); sizes consistent (see module
    docstring); the canonical tensors' index carried (`merge_engine.layouts.tensor_index`)."""
    from merge_engine.layouts.tensor_index import carry

    root, files = _choose_root(url, files)
    opened: Opened = {}
    try:
        grid = _grid(root, files, opened)
        archives = _open_all(root, grid, opened)
        tensors = canonical_tensors(grid, archives)
    finally:
        _close_all(opened)
    rank_file = RANK_FILE.match(next(iter(grid.files.values())).path)
    assert rank_file is not None  # the grid holds rank files only
    prefix = rank_file.group("prefix")
    hf_dir = _hf_dir(root, files, prefix)
    hf_folder = hf_dir.rstrip("/").rsplit("/", 1)[-1] + "/" if hf_dir else None
    entries = tuple(sorted([*grid.files.values(), *(f for f in files if hf_folder and f.path.startswith(hf_folder)
                                                    and "/" not in f.path[len(hf_folder):])], key=lambda f: f.path))
    notes = ("Megatron-LM model_optim_rng.pt" if grid.kind == MEGATRON_LM_FILE else "verl legacy model.pt",)
    return Checkpoint(url=root, layout=NAME, files=entries,
                      parallel={"tp": grid.tp, "pp": grid.pp, "ep": grid.ep, "vpp": grid.vpp},
                      hf_dir=hf_dir, fingerprint=storage.fingerprint(entries), notes=notes,
                      lora=holds_lora(tensors), index=carry(tensors, list(archives.values())))


def _open_all(url: str, grid: RankGrid, opened: Opened) -> dict[tuple[int, int, int], TorchArchive]:
    """Every rank file of the grid, parsed (those `_grid` parsed are reused from ``opened``)."""
    archives: dict[tuple[int, int, int], TorchArchive] = {}
    for coords, entry in grid.files.items():
        archives[coords] = _open_archive(url, entry, opened)
        archives[coords].load()
    return archives


def _states_by_rank(grid: RankGrid, archives: dict[tuple[int, int, int], TorchArchive]
                    ) -> dict[tuple[int, int, int], list[dict[str, Any]]]:
    """Chunk state dicts per rank; checks VPP counts, key sets across TP and the last stage."""
    states = {}
    for coords, archive in archives.items():
        chunks, _ = chunk_states(archive.load(), archive)
        if len(chunks) != grid.vpp:
            raise CorruptShard(f"{len(chunks)} model chunks here, {grid.vpp} in TP rank 0's file (VPP mismatch)",
                               archive.url)
        states[coords] = chunks
    for (t, p, e), chunks in states.items():
        reference = states[(0, p, e)]
        for v, (mine, theirs) in enumerate(zip(chunks, reference)):
            if set(mine) != set(theirs):
                diff = sorted(set(mine) ^ set(theirs))[:3]
                raise CorruptShard(f"chunk {v} holds different tensors than TP rank 0 of the same stage "
                                   f"(e.g. {diff})", archives[(t, p, e)].url)
    last = states[(0, grid.pp - 1, 0)][grid.vpp - 1]
    if not any(k.endswith(FINAL_NORM) for k in last):
        raise IncompleteCheckpoint(f"the last pipeline stage found (PP={grid.pp}) holds no {FINAL_NORM}: "
                                   "later stages are missing", archives[(0, grid.pp - 1, 0)].url)
    return states


def _row_slice(piece: StoredTensor, start: int, stop: int) -> StoredTensor:
    from merge_engine.formats.stored_tensor import StoredTensor

    return StoredTensor(piece.archive, piece.storage, piece.offset + start * piece.stride[0],
                        (stop - start, *piece.shape[1:]), piece.stride)


def gather(pieces: list[StoredTensor], kind: TPKind, name: str):
    """The lazy full tensor from TP rank 0..n-1's pieces (see `merge_engine.architectures.parallel`)."""
    from merge_engine.architectures.parallel import TPKind
    from merge_engine.formats.tensor_source import ConcatTensor, ReplicatedTensor
    from merge_engine.formats.stored_tensor import StoredTensor

    if any(not isinstance(p, StoredTensor) for p in pieces):
        bad = next(p for p in pieces if not isinstance(p, StoredTensor))
        raise UnsupportedLayout(f"{name!r} holds a {type(bad).__name__}, not a tensor", None)
    first = pieces[0]
    if kind is TPKind.REPLICATED or len(pieces) == 1:
        return ReplicatedTensor(tuple(pieces))
    if kind is TPKind.ROW:
        shape = (first.shape[0], sum(p.shape[1] for p in pieces), *first.shape[2:])
        return ConcatTensor(shape, first.dtype_name, 1, tuple(pieces))
    shape = (sum(p.shape[0] for p in pieces), *first.shape[1:])
    if kind is TPKind.COLUMN:
        return ConcatTensor(shape, first.dtype_name, 0, tuple(pieces))
    halves = []
    for piece in pieces:
        if piece.shape[0] % 2:
            raise CorruptShard(f"{name}: gated linear_fc1 piece with an odd row count {piece.shape[0]}",
                               piece.archive.url)
        half = piece.shape[0] // 2
        halves.append((_row_slice(piece, 0, half), _row_slice(piece, half, piece.shape[0])))
    return ConcatTensor(shape, first.dtype_name, 0, tuple(g for g, _ in halves) + tuple(u for _, u in halves))


def _fc1_gated(state: dict[str, Any], key: str) -> bool:
    from merge_engine.architectures.parallel import is_gated_fc1
    from merge_engine.formats.stored_tensor import StoredTensor

    fc2 = state.get(key.replace("linear_fc1", "linear_fc2").replace(".bias", ".weight"))
    fc1 = state.get(key.replace(".bias", ".weight"))
    if not isinstance(fc2, StoredTensor) or not isinstance(fc1, StoredTensor):
        return True
    try:
        return is_gated_fc1(fc1.shape[0], fc2.shape[1])
    except ValueError as exc:
        raise CorruptShard(f"{key}: {exc}", fc1.archive.url) from None


def _layer_counts(states: dict[tuple[int, int, int], list[dict[str, Any]]], grid: RankGrid) -> dict[tuple[int, int], int]:
    """(pp, vpp) -> the global number of the chunk's first layer, in (v, p) order."""
    offsets, at = {}, 0
    for v in range(grid.vpp):
        for p in range(grid.pp):
            offsets[(p, v)] = at
            local = {int(m.group(1)) for k in states[(0, p, 0)][v] if (m := LAYER_NAME.match(k))}
            if local and sorted(local) != list(range(len(local))):
                raise CorruptShard(f"chunk {v} of stage {p} has layers {sorted(local)}, not 0..{len(local) - 1}", None)
            at += len(local)
    return offsets


def canonical_tensors(grid: RankGrid, archives: dict[tuple[int, int, int], TorchArchive]) -> dict[str, Any]:
    """Canonical Megatron name -> lazy full tensor, in model order (see module docstring)."""
    from merge_engine.architectures.parallel import MLA_KV_DOWN, MLA_Q_DOWN, tp_kind
    from merge_engine.formats.stored_tensor import StoredTensor

    states = _states_by_rank(grid, archives)
    offsets = _layer_counts(states, grid)
    tensors: dict[str, Any] = {}
    for v in range(grid.vpp):
        for p in range(grid.pp):
            for e in range(grid.ep):
                state0 = states[(0, p, e)][v]
                experts = _local_expert_count(state0)
                for key, value in state0.items():
                    if is_extra_state(key) or value is None:
                        continue
                    name, is_expert = _canonical(key, offsets[(p, v)], e, experts)
                    if name is None or (e > 0 and not is_expert):
                        continue  # everything but the experts is repeated on every EP rank: read EP rank 0's
                    gated = _fc1_gated(state0, key) if "linear_fc1" in key else True
                    pieces = [states[(t, p, e)][v][key] for t in range(grid.tp)]
                    if name == EMBEDDING and name in tensors and any(k.startswith("mtp.") for k in state0):
                        name = MTP_EMBEDDING  # the last stage's own copy, for its MTP layers
                    if name in tensors:
                        raise CorruptShard(f"{name} is stored twice (stage {p}, chunk {v})", archives[(0, p, e)].url)
                    rows = [piece.shape[0] if isinstance(piece, StoredTensor) and piece.shape else 0 for piece in pieces]
                    kind = tp_kind(name, gated, rows)
                    if grid.tp > 1 and key.endswith((MLA_Q_DOWN, MLA_KV_DOWN)):
                        kind = _mla_down_kind(key, [states[(t, p, e)][v] for t in range(grid.tp)],
                                              archives[(0, p, e)].url)
                    tensors[name] = gather(pieces, kind, name)
    return dict(sorted(tensors.items(), key=lambda item: order_key(item[0])))


def _mla_down_kind(key: str, tp_states: list[dict[str, Any]], url: str) -> TPKind:
    """Duplicated (TransformerEngine) or column-parallel (local spec) MLA down-projection ``key``,
    from its layer's q pieces and names (`mla_down_projection_kind`); `CorruptShard` when they fit neither."""
    from merge_engine.architectures.parallel import (
        MLA_KV_DOWN, MLA_Q_DOWN, MLA_Q_UP, MLA_TE_NORMS, mla_down_projection_kind,
    )
    from merge_engine.formats.stored_tensor import StoredTensor

    prefix = key[: -len(MLA_KV_DOWN if key.endswith(MLA_KV_DOWN) else MLA_Q_DOWN)]
    q_pieces = [state.get(prefix + MLA_Q_DOWN) for state in tp_states]
    q_up = tp_states[0].get(prefix + MLA_Q_UP)
    q_rows = [p.shape[0] for p in q_pieces if isinstance(p, StoredTensor)] if all(isinstance(p, StoredTensor) and p.shape for p in q_pieces) else None
    q_rank = q_up.shape[1] if isinstance(q_up, StoredTensor) and len(q_up.shape) == 2 else None
    try:
        return mla_down_projection_kind(q_rows, q_rank, any(prefix + n in tp_states[0] for n in MLA_TE_NORMS))
    except ValueError as exc:
        raise CorruptShard(f"{key}: {exc}", url) from None


def _local_expert_count(state: dict[str, Any]) -> int:
    found = set()
    for key in state:
        match = LAYER_NAME.match(key) or MTP_TRANSFORMER_LAYER.match(key)
        if match:
            expert = EXPERT_NAME.match(canonical_layer_name(match.group(2)))
            if expert:
                found.add(int(expert.group(1)))
    return len(found)


def _canonical(key: str, first_layer: int, ep_rank: int, local_experts: int) -> tuple[str | None, bool]:
    mtp = MTP_TRANSFORMER_LAYER.match(key)
    if mtp:  # a multi-token-prediction layer's decoder layer (last stage): no layer offset, global experts
        rest = canonical_layer_name(mtp.group(2))
        expert = EXPERT_NAME.match(rest)
        if expert:
            rest = expert_name(ep_rank * local_experts + int(expert.group(1)), expert.group(2))
        return f"{mtp.group(1)}.{rest}", bool(expert)
    match = LAYER_NAME.match(key)
    if not match:
        return key, False
    rest = canonical_layer_name(match.group(2))
    expert = EXPERT_NAME.match(rest)
    if expert:
        rest = expert_name(ep_rank * local_experts + int(expert.group(1)), expert.group(2))
    return layer_name(first_layer + int(match.group(1)), rest), bool(expert)


def open(checkpoint: Checkpoint) -> TensorSource:  # noqa: A001 - the layout contract's verb
    """The canonical Megatron tensors of the checkpoint, lazily: from the index the check carried
    (nothing read), else from the rank files' headers (no weights)."""
    from merge_engine.layouts.tensor_index import restore
    from merge_engine.formats.tensor_source import AssembledSource

    restored = restore(checkpoint)
    if restored is not None:
        tensors, handles = restored
    else:
        opened: Opened = {}
        try:
            grid = _grid(checkpoint.url, list(checkpoint.files), opened)
            tensors = canonical_tensors(grid, _open_all(checkpoint.url, grid, opened))
        except Exception:
            _close_all(opened)
            raise
        handles = list(opened.values())
    source = AssembledSource(checkpoint.url, tensors, handles)
    source.parallel = dict(checkpoint.parallel)
    return source


# --------------------------------------------------------------------------------------------------
# Writing (``stepmerge split --format legacy``): verl's layout, a list of local-spec state dicts per rank
# file, one per VPP chunk, local layer and expert numbers, each rank's TP piece


def _local_name(name: str, first_layer: int, experts_per_rank: int) -> tuple[str, int | None]:
    """Canonical name -> (name inside its chunk, EP rank owning it or None when on every EP rank)."""
    match = LAYER_NAME.match(name)
    if not match:
        return name, None
    rest, owner = match.group(2), None
    expert = EXPERT_NAME.match(rest)
    if expert:
        number = int(expert.group(1))
        owner = number // experts_per_rank
        rest = expert_name(number % experts_per_rank, expert.group(2))
    return layer_name(int(match.group(1)) - first_layer, rest), owner


def _with_extra_states(state: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in state.items():
        out[key] = value
        module, _, leaf = key.rpartition(".")
        if leaf == "weight" and module.rsplit(".", 1)[-1] in EXTRA_STATE_MODULES:
            out[f"{module}._extra_state"] = None
    return out


def _stage_names(view: MegatronViewOfHf, sizes: ParallelSizes, p: int, e: int) -> list[list[tuple[str, str]]]:
    """Per VPP chunk of stage ``p`` on EP rank ``e``: (name in the rank file, canonical source name),
    in file order. Metadata only."""
    dims = view.dims
    vpp = sizes.vpp or 1
    per_chunk = dims.num_layers // (sizes.pp * vpp)
    experts_per_rank = max(1, dims.num_experts // sizes.ep) if dims.num_experts else 1
    chunks = []
    for v in range(vpp):
        first_layer = (v * sizes.pp + p) * per_chunk
        layers = range(first_layer, first_layer + per_chunk)
        first, last = p == 0 and v == 0, p == sizes.pp - 1 and v == vpp - 1
        placed = []
        for name in view.metas():
            match = LAYER_NAME.match(name)
            if match:
                if int(match.group(1)) not in layers:
                    continue
            elif name.startswith("embedding."):
                if not first:
                    continue
            elif not last:
                continue
            local, owner = _local_name(name, first_layer, experts_per_rank)
            if owner is None or owner == e:
                placed.append((local, name))
        if last and dims.tied and not first:
            # tied with PP > 1: the last stage holds its own copy of the embedding as output layer
            placed.append(("output_layer.weight", "embedding.word_embeddings.weight"))
        chunks.append(placed)
    return chunks


def _rank_folder(t: int, p: int, e: int, sizes: ParallelSizes) -> str:
    return f"mp_rank_{t:02d}" + (f"_{p:03d}" if sizes.pp > 1 else "") + (f"_{e:03d}" if sizes.ep > 1 else "")


def file_jobs(view: MegatronViewOfHf, sizes: ParallelSizes) -> list[FileJob]:
    """One job per rank file ``model/mp_rank_*/model.pt`` ((pp, ep, tp) order), from metadata alone
    (`Writer`)."""
    jobs = []
    for p in range(sizes.pp):
        for e in range(sizes.ep):
            names = tuple(name for placed in _stage_names(view, sizes, p, e) for _, name in placed)
            for t in range(sizes.tp):
                jobs.append(FileJob(f"model/{_rank_folder(t, p, e, sizes)}/model.pt", (p, e, t), names))
    return jobs


def write_file(view: MegatronViewOfHf, job: FileJob, target_url: str, sizes: ParallelSizes,
               dtype: torch.dtype | None, cancel: Any = None) -> FileRecord:
    """One rank file (`Writer`): TP rank t's pieces of stage p on EP rank e, one ``torch.save``.

    A rank file is one ``torch.save``, so its tensors are held while it is built: one TP rank's
    share of one pipeline stage, plus the full tensor being cut. Each tensor is read (and cut)
    once per rank file.
    """
    import torch

    p, e, t = job.part
    states = []
    for placed in _stage_names(view, sizes, p, e):
        state = {}
        for local, name in placed:
            if cancel is not None and cancel.is_set():
                raise WriteCancelled(job.file)
            state[local] = _rank_piece(view, name, t, sizes.tp, dtype)
        states.append(_with_extra_states(state))
    with HashingWriter(storage.join(target_url, job.file)) as out:
        torch.save(states, out)
    return FileRecord(job.file, out.size, out.sha256(), job.tensors)


def finish(records: Sequence[FileRecord], target_url: str) -> list[FileRecord]:
    """Nothing to add: each rank file stands alone (`Writer`)."""
    return []


def _rank_piece(view: MegatronViewOfHf, name: str, rank: int, tp: int, dtype: torch.dtype | None) -> torch.Tensor:
    """TP rank ``rank``'s piece of the canonical tensor ``name``, in its own storage (the full
    tensor it was cut from is freed)."""
    from merge_engine.architectures.parallel import split_tp, tp_kind

    tensor = view.read(name)
    if dtype is not None:
        tensor = tensor.to(dtype)
    piece = split_tp(tensor, tp_kind(name, view.gated(name)), tp)[rank]
    return piece.clone() if tp > 1 else piece


LAYOUT = Layout(
    name=NAME,
    tensor_naming=TENSOR_NAMING,
    detect=detect,
    listing_verdict=listing_verdict,
    check_complete=check_complete,
    open=open,
    writer=Writer(config_dir=CONFIG_DIR, file_jobs=file_jobs, write_file=write_file, finish=finish),
)
