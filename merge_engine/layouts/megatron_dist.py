"""Megatron ``torch_dist`` checkpoints (dist_checkpointing over torch.distributed.checkpoint),
read without megatron-core, a GPU or a process group.

Where the shards are, relative to the folder given:

- verl v2 (0.9):  ``model/dist_ckpt/`` (+ ``model/huggingface/`` config, ``extra/dist_ckpt/`` RNG,
                  ``optimizer/dist_ckpt/``); ``ckpt_contents.json`` is written LAST and is the
                  completeness marker;
- verl v1:        ``dist_ckpt/`` (model, RNG and optimizer state together) + ``huggingface/``;
- Megatron-LM:    the ``iter_NNNNNNN/`` folder itself (``--ckpt-format torch_dist``), or a run root
                  with ``latest_checkpointed_iteration.txt``; any folder holding ``.metadata``.

Keys are global, without a ``model.`` prefix, with TransformerEngine-style names, and per-layer
tensors stacked on a leading dimension (``decoder.layers.self_attention.linear_qkv.weight`` is
``[layers, rows, hidden]``; experts ``decoder.layers.mlp.experts.experts.linear_fc1.weight`` is
``[layers, experts, rows, hidden]``). When layers differ (some dense, some MoE: first dense layers,
``moe_layer_freq``; also ``singleton_local_shards``) megatron-core keys each layer on its own:
``decoder.layers.3.self_attention.linear_qkv.weight`` and, per MoE layer, the experts stacked on
their own: ``decoder.layers.3.mlp.experts.experts.linear_fc1.weight`` ``[experts, rows, hidden]``.
`open` gives the canonical Megatron tensors (one per layer
and expert, see `merge_engine.architectures.megatron_names`), each a lazy box of its stacked
tensor: a layer's bytes are read only when that layer is written.

Completeness: ``.metadata`` and ``metadata.json`` (torch_dist backend) present, every data file the
metadata names present and long enough, model tensors present (a folder holding only optimizer or
RNG state gets an error saying so), the v2 marker present.

Importing this module imports no torch (the registry and discovery read names and sizes only): the
DCP reader and writer are imported by `check_complete`, `open` and the writers.
"""

from __future__ import annotations

import hashlib
import io
import json
import re
from collections.abc import Mapping, Sequence
from functools import cache
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
    is_mla,
    layer_name,
    order_key,
    with_prefix,
    without_language_model_prefix,
)
from merge_engine.formats.dcp_file_names import DATA_SUFFIX, METADATA_FILE
from merge_engine.errors import CorruptShard, IncompleteCheckpoint, UnsupportedLayout
from merge_engine.formats.json_file import read_json_object
from merge_engine.layouts import verl_v2
from merge_engine.layouts.contract import (
    ABSENT,
    DONE,
    INCOMPLETE,
    MEGATRON_NAMES,
    Checkpoint,
    FileJob,
    Layout,
    ParallelSizes,
    Verdict,
    Writer,
    by_path,
)
from merge_engine.storage.written import FileRecord, WriteCancelled
from merge_engine.layouts.megatron_lm_root import choose_iteration
from merge_engine.storage import FileEntry

if TYPE_CHECKING:  # the reader and writer import torch: imported by check_complete / open / the writers, not with the registry
    import torch

    from merge_engine.architectures.hf_to_megatron import MegatronViewOfHf
    from merge_engine.formats.tensor_source import TensorSource
    from merge_engine.formats.torch_dcp import DcpFiles, DcpTensor
    from merge_engine.formats.dcp_index import DcpIndex

NAME = "megatron_dist"
TENSOR_NAMING = MEGATRON_NAMES
CONFIG_DIR = "huggingface"  # where `write`'s caller puts config.json + tokenizer
V2_MARKER = verl_v2.CONTENTS_MARKER
MEGATRON_METADATA = "metadata.json"
TRANSFORMER_CONFIG = "transformer_config.json"
MODEL_FOLDERS = ("model/dist_ckpt/", "dist_ckpt/", "")  # detection order
STATE_ONLY_FOLDERS = ("extra/dist_ckpt/", "optimizer/dist_ckpt/")
HF_FOLDERS = {"model/dist_ckpt/": "model/huggingface", "dist_ckpt/": "huggingface", "": None}
ITER_METADATA = re.compile(r"^(iter_[0-9]+)/\.metadata$")
# keys of a dist_ckpt that are not model weights; Megatron's ChainedOptimizer (MoE: one optimizer for
# the dense parameters, one for the experts) prefixes each optimizer's keys with ``chained_<i>.``
NON_MODEL_KEY = re.compile(r"^(?:chained_[0-9]+\.)?(?:optimizer|rng_state|lr_scheduler|opt_param_scheduler"
                           r"|num_floating_point_operations)")
STACKED = "decoder.layers."
# Megatron-Bridge PEFT's adapter keys (``...linear_qkv.adapter.linear_in.weight``): a LoRA run's step
ADAPTER_KEY = ".adapter.linear_"
STACKED_EXPERTS = "mlp.experts.experts."


def _in_folder(path: str, folder: str) -> bool:
    return path.startswith(folder) and (bool(folder) or "/" not in path)


def _has_shards(files: Sequence[FileEntry], folder: str) -> bool:
    return any(_in_folder(f.path, folder) and (f.path.endswith(DATA_SUFFIX) or f.path.endswith(METADATA_FILE))
               for f in files)


def detect(files: Sequence[FileEntry]) -> bool:
    return (any(_has_shards(files, folder) for folder in MODEL_FOLDERS + STATE_ONLY_FOLDERS)
            or any(ITER_METADATA.match(f.path) for f in files))


# what proves a step saved its model as a dist checkpoint (a watcher's view: a step holding only optimizer
# state is not one)
LISTING_PROOF = re.compile(r"^(?:(?:model/)?dist_ckpt/.+|[^/]+\.distcp)$")


def listing_verdict(files: Sequence[FileEntry]) -> Verdict:
    """verl v2 ``model/dist_ckpt/``: the ``ckpt_contents.json`` marker. verl v1 ``dist_ckpt/`` and
    Megatron-LM ``torch_dist`` iterations: ``.metadata`` (written by the DCP coordinator after every
    rank's data) and ``metadata.json`` (megatron-core writes it after that) both present."""
    if not any(LISTING_PROOF.match(f.path) for f in files):
        return ABSENT
    paths = by_path(files)
    if any(p.startswith(verl_v2.MODEL_DIST_DIR) for p in paths):
        return verl_v2.marker_verdict(files)
    folder = "dist_ckpt/" if any(p.startswith("dist_ckpt/") for p in paths) else ""
    missing = [name for name in (METADATA_FILE, MEGATRON_METADATA) if folder + name not in paths]
    if missing:
        return Verdict(INCOMPLETE, f"{folder or './'} lacks {', '.join(missing)} (written last)")
    return DONE


def _choose_root(url: str, files: list[FileEntry]) -> tuple[str, list[FileEntry]]:
    """A Megatron-LM run root -> its iteration folder (tracker, or the only one); else ``url`` itself."""
    if any(_has_shards(files, folder) for folder in MODEL_FOLDERS + STATE_ONLY_FOLDERS):
        return url, files
    iterations = {m.group(1) for f in files if (m := ITER_METADATA.match(f.path))}
    return choose_iteration(url, files, iterations, holds=METADATA_FILE)


def _model_folder(url: str, files: list[FileEntry]) -> str:
    for folder in MODEL_FOLDERS:
        if _has_shards(files, folder):
            return folder
    held = [f.rstrip("/") for f in STATE_ONLY_FOLDERS if _has_shards(files, f)]
    raise IncompleteCheckpoint(
        f"no model weights here: only {' and '.join(held)} (optimizer / RNG state). verl saves the weights of a "
        "bridge run as safetensors in model/huggingface/ (save_contents must include 'model'); this step has none",
        url)


def is_model_key(key: str) -> bool:
    """False for optimizer (also ``chained_N.optimizer...``), RNG and scheduler state and extra states."""
    return not NON_MODEL_KEY.match(key) and not is_extra_state(key)


def check_files(index: DcpIndex, folder_url: str, files: dict[str, FileEntry]) -> None:
    ends: dict[str, int] = {}
    for info in index.tensors.values():
        for chunk in info.chunks:
            loc = chunk.location
            ends[loc.file] = max(ends.get(loc.file, 0), loc.offset + loc.length)
    for loc in index.objects.values():
        ends[loc.file] = max(ends.get(loc.file, 0), loc.offset + loc.length)
    for name, end in sorted(ends.items()):
        if "/" in name or name.startswith("."):
            raise CorruptShard(f"metadata names an unsafe data file {name!r}", folder_url)
        entry = files.get(name)
        if entry is None:
            raise IncompleteCheckpoint("data file named by .metadata is missing", storage.join(folder_url, name))
        if entry.size < end:
            raise IncompleteCheckpoint(f"data file holds {entry.size} bytes, .metadata needs {end}: truncated",
                                       storage.join(folder_url, name))


def parallel_sizes(url: str, files: list[FileEntry]) -> dict[str, int]:
    """TP/PP/EP/VPP sizes recorded in verl's ``transformer_config.json`` ({} when absent)."""
    if not any(f.path == TRANSFORMER_CONFIG for f in files):
        return {}
    config = read_json_object(storage.join(url, TRANSFORMER_CONFIG)) or {}
    keys = {"tp": "tensor_model_parallel_size", "pp": "pipeline_model_parallel_size",
            "ep": "expert_model_parallel_size", "vpp": "virtual_pipeline_model_parallel_size"}
    return {k: int(config[v]) for k, v in keys.items() if isinstance(config.get(v), int)}


def check_complete(url: str, files: list[FileEntry]) -> Checkpoint:
    """See the module docstring; reads ``.metadata`` and the small JSON files, no weights. The checkpoint
    carries the parsed index (`Checkpoint.index`: `open` reads ``.metadata`` no more) and, for a LoRA run's
    step, what the marker and the keys say of its adapter (`Checkpoint.lora`, ``adapter_only``, ``adapter_dir``)."""
    from merge_engine.formats.dcp_index import read_index
    from merge_engine.layouts.tensor_index import carry_dcp

    root, files = _choose_root(url, files)
    folder = _model_folder(root, files)
    paths = {f.path: f for f in files}
    if folder == "model/dist_ckpt/":
        if V2_MARKER not in paths:
            raise IncompleteCheckpoint(f"{V2_MARKER} (written last by verl) not present yet",
                                       storage.join(root, V2_MARKER))
        contents = read_json_object(storage.join(root, V2_MARKER)) or {}
        model = (contents.get("contents") or {}).get("model") or {}
        # a LoRA run: the adapter is here, the model's folder holds config and the PEFT export
        if model.get("format") not in (None, "megatron_dist_checkpoint") and not verl_v2.trains_lora(contents):
            raise UnsupportedLayout(f"{V2_MARKER} says the model is saved as {model.get('format')!r} in "
                                    f"{model.get('path')!r}, not as a dist checkpoint", storage.join(root, V2_MARKER))
    folder_url = storage.join(root, folder.rstrip("/")) if folder else root
    for required in (METADATA_FILE, MEGATRON_METADATA):
        if folder + required not in paths:
            raise IncompleteCheckpoint(f"{required} missing (written at the end of the save)",
                                       storage.join(folder_url, required))
    backend = (read_json_object(storage.join(folder_url, MEGATRON_METADATA)) or {}).get("sharded_backend")
    if backend != "torch_dist":
        raise UnsupportedLayout(f"sharded_backend {backend!r}: only torch_dist checkpoints are read; re-save with "
                                "--ckpt-format torch_dist", storage.join(folder_url, MEGATRON_METADATA))
    index = read_index(folder_url, layout=NAME)
    check_files(index, folder_url, {f.path[len(folder):]: f for f in files if _in_folder(f.path, folder)})
    if not any(is_model_key(k) for k in index.tensors):
        kinds = sorted({k.split("/")[0].split(".")[0] for k in list(index.tensors) + list(index.objects)})
        raise IncompleteCheckpoint(f"this dist checkpoint holds no model weights, only {', '.join(kinds) or 'nothing'} "
                                   "(optimizer / RNG state); point at the folder with the model, or at the "
                                   "step's huggingface/ weights", folder_url)
    hf = HF_FOLDERS[folder]
    hf_dir = storage.join(root, hf) if hf and f"{hf}/config.json" in paths else None
    keep = [f for f in files if _in_folder(f.path, folder) or f.path in (V2_MARKER, TRANSFORMER_CONFIG)
            or (hf and f.path.startswith(hf + "/") and "/" not in f.path[len(hf) + 1:])]
    entries = tuple(sorted(keep, key=lambda f: f.path))
    notes = ({"model/dist_ckpt/": "verl v2 dist_ckpt", "dist_ckpt/": "verl v1 dist_ckpt",
              "": "Megatron-LM torch_dist"}[folder],)
    adapter = [k for k in index.tensors if ADAPTER_KEY in k]  # Megatron-Bridge PEFT: a layout refines this one
    base = any(is_model_key(k) and ADAPTER_KEY not in k for k in index.tensors)
    return Checkpoint(url=root, layout=NAME, files=entries, parallel=parallel_sizes(root, files), hf_dir=hf_dir,
                      fingerprint=storage.fingerprint(entries), notes=notes,
                      lora=bool(adapter), adapter_only=bool(adapter) and not base,
                      adapter_dir=verl_v2.declared_adapter_dir(contents) if adapter and folder == "model/dist_ckpt/"
                      else None,
                      index=carry_dcp(index))


def canonical_tensors(index: DcpIndex, files: DcpFiles) -> dict[str, DcpTensor]:
    """Canonical Megatron name -> lazy box of its global tensor, in model order."""
    from merge_engine.formats.torch_dcp import DcpTensor

    out: dict[str, DcpTensor] = {}

    def add(name: str, tensor: DcpTensor) -> None:
        if name in out:
            raise CorruptShard(f"two keys give {name} ({out[name].key} and {tensor.key})", index.url)
        out[name] = tensor

    for key, info in index.tensors.items():
        if not is_model_key(key):
            continue
        name = without_language_model_prefix(key)  # Megatron-Bridge's vision-language models
        mtp = MTP_TRANSFORMER_LAYER.match(name)
        if mtp:  # a multi-token-prediction layer's decoder layer: keyed on its own, experts stacked on dim 0
            prefix, local = mtp.groups()
            if local.startswith(STACKED_EXPERTS):
                for expert in range(info.shape[0] if info.shape else 0):
                    add(f"{prefix}.{expert_name(expert, local[len(STACKED_EXPERTS):])}",
                        DcpTensor(key, info, files, (expert,)))
            else:
                add(f"{prefix}.{canonical_layer_name(local)}", DcpTensor(key, info, files))
            continue
        rest = name[len(STACKED):] if name.startswith(STACKED) else None
        per_layer = rest is not None and rest.split(".", 1)[0].isdigit()
        if rest is not None and not per_layer and not all(info.shape):
            # one entry per layer (and expert) is made below: only bytes on disk may decide how many
            raise CorruptShard(f"{key!r}: a stacked tensor of shape {info.shape} holds no weights", index.url)
        if per_layer and rest is not None and rest.split(".", 1)[1].startswith(STACKED_EXPERTS):  # one layer's experts, stacked
            number, local = rest.split(".", 1)
            part = local[len(STACKED_EXPERTS):]
            if len(info.shape) < 1:
                raise CorruptShard(f"{key!r} {info.shape}: experts need [experts, ...]", index.url)
            for expert in range(info.shape[0]):
                add(layer_name(int(number), expert_name(expert, part)), DcpTensor(key, info, files, (expert,)))
        elif rest is None or per_layer:  # not stacked: a global or a per-layer key
            add(name if rest is None else _unstacked(rest), DcpTensor(key, info, files))
        elif rest.startswith(STACKED_EXPERTS):
            part = rest[len(STACKED_EXPERTS):]
            if len(info.shape) < 2:
                raise CorruptShard(f"{key!r} {info.shape}: experts need [layers, experts, ...]", index.url)
            for layer in range(info.shape[0]):
                for expert in range(info.shape[1]):
                    add(layer_name(layer, expert_name(expert, part)), DcpTensor(key, info, files, (layer, expert)))
        else:
            local = canonical_layer_name(rest)
            for layer in range(info.shape[0]):
                add(layer_name(layer, local), DcpTensor(key, info, files, (layer,)))
    return dict(sorted(out.items(), key=lambda item: order_key(item[0])))


def _unstacked(rest: str) -> str:
    number, name = rest.split(".", 1)
    return layer_name(int(number), canonical_layer_name(name))


def _folder_url(checkpoint: Checkpoint) -> tuple[str, str]:
    folder = _model_folder(checkpoint.url, list(checkpoint.files))
    return folder, storage.join(checkpoint.url, folder.rstrip("/")) if folder else checkpoint.url


def open(checkpoint: Checkpoint) -> TensorSource:  # noqa: A001 - the layout contract's verb
    """The canonical Megatron tensors, lazily (``.metadata`` read; chunk headers on first use)."""
    from merge_engine.formats.tensor_source import AssembledSource
    from merge_engine.formats.torch_dcp import DcpFiles
    from merge_engine.formats.dcp_index import read_index

    from merge_engine.layouts.tensor_index import restore_dcp

    folder, folder_url = _folder_url(checkpoint)
    index = restore_dcp(checkpoint, folder) or read_index(folder_url, layout=NAME)
    listed = [f for f in checkpoint.files if _in_folder(f.path, folder)]
    files = DcpFiles(folder_url, {f.path[len(folder):]: f.size for f in listed},
                     {f.path[len(folder):]: f.version for f in listed})
    return AssembledSource(checkpoint.url, canonical_tensors(index, files), [files])


# --------------------------------------------------------------------------------------------------
# Writing (``stepmerge split --format dist``): verl v1's layout, global keys, layers stacked on dim 0
# (each layer keyed on its own when dense and MoE layers are mixed, as megatron-core does)

DIST_DIR = "dist_ckpt"
MEGATRON_DIST_METADATA = {"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                          "common_backend": "torch", "common_backend_version": 1}
# canonical (local-spec) layer names -> torch_dist keys (TransformerEngine-style); megatron-core's
# local MLA spec has no such map, so multi-latent attention models keep the module names
_DIST_RENAMES = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
                 "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight"}


def _dist_key(name: str, dims, renames: Mapping[str, str] = _DIST_RENAMES
              ) -> tuple[str, tuple[int, ...], tuple[int, ...]]:
    """Canonical name -> (torch_dist key, leading indices, leading global sizes).

    Layers stacked on dim 0 (experts on dim 1) as megatron-core keys homogeneous layers; with mixed
    dense / MoE layers, each layer keyed on its own and its experts stacked on dim 0, as
    megatron-core keys non-homogeneous layers (``moe_layer_freq``).
    """
    match = LAYER_NAME.match(name)
    if not match:
        return name, (), ()
    layer, rest = int(match.group(1)), match.group(2)
    expert = EXPERT_NAME.match(rest)
    if dims.mixed_layers:
        if expert:
            return (f"decoder.layers.{layer}.mlp.experts.experts.{expert.group(2)}", (int(expert.group(1)),),
                    (dims.num_experts,))
        return f"decoder.layers.{layer}.{renames.get(rest, rest)}", (), ()
    if expert:
        return (f"decoder.layers.mlp.experts.experts.{expert.group(2)}", (layer, int(expert.group(1))),
                (dims.num_layers, dims.num_experts))
    return f"decoder.layers.{renames.get(rest, rest)}", (layer,), (dims.num_layers,)


def _data_file(group: int) -> str:
    return f"__{group}_0{DATA_SUFFIX}"


def file_jobs(view: MegatronViewOfHf, sizes: ParallelSizes) -> list[FileJob]:
    """One data file per decoder layer (``dist_ckpt/__<layer>_0.distcp``, its experts included), then one
    for the tensors outside the layers (``__<num_layers>_0.distcp``), from metadata alone (`Writer`).
    ``sizes`` do not shape the files: megatron-core reshards a dist checkpoint on load."""
    groups: dict[int, list[str]] = {}
    outside = view.dims.num_layers
    for name in view.metas():
        match = LAYER_NAME.match(name)
        groups.setdefault(int(match.group(1)) if match else outside, []).append(name)
    return [FileJob(f"{DIST_DIR}/{_data_file(group)}", (group,), tuple(names))
            for group, names in sorted(groups.items())]


def write_file(view: MegatronViewOfHf, job: FileJob, target_url: str, sizes: ParallelSizes,
               dtype: torch.dtype | None, cancel: Any = None) -> FileRecord:
    """One data file (`Writer`): torch_dist keys, one DCP chunk per layer (and expert), extra states
    as bytes entries; its record carries the items' locations for `finish`. Memory: one tensor at a time."""
    from merge_engine.formats.torch_dcp_writer import DcpDataFile

    dims = view.dims
    renames = {} if is_mla(view.metas()) else _DIST_RENAMES
    extra_states = set()
    with DcpDataFile(storage.join(target_url, DIST_DIR), _data_file(job.part[0])) as data:
        for name in job.tensors:
            if cancel is not None and cancel.is_set():
                raise WriteCancelled(job.file)
            meta = view.metas()[name]
            key, lead, lead_sizes = _dist_key(name, dims, renames)
            key = with_prefix(key, view.megatron_prefix)
            tensor = view.read(name)
            if dtype is not None:
                tensor = tensor.to(dtype)
            data.add_chunk(key, (*lead_sizes, *meta.shape), (*lead, *(0,) * len(meta.shape)),
                           tensor.reshape((1,) * len(lead) + tuple(meta.shape)))
            del tensor
            module, _, leaf = key.rpartition(".")
            if (lead or dims.mixed_layers) and leaf == "weight" and module.rsplit(".", 1)[-1] in EXTRA_STATE_MODULES:
                # a per-layer key of mixed layers is a shard of one: megatron-core names it 0_1
                shard = (".".join(map(str, lead)) + "_" + ".".join(map(str, lead_sizes))) if lead else "0_1"
                extra = f"{module}._extra_state/shard_{shard}"
                if extra not in extra_states:  # each extra state's key names its layer: one file holds it
                    extra_states.add(extra)
                    data.add_object(extra, _none_object())
    return FileRecord(job.file, data.size, data.sha256(), job.tensors, tuple(data.items))


def _torch_saved(value: Any) -> bytes:
    import torch

    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


@cache
def _none_object() -> bytes:
    """An extra state's bytes: megatron-core saves a ShardedObject as a one-item list."""
    return _torch_saved([None])


def finish(records: Sequence[FileRecord], target_url: str) -> list[FileRecord]:
    """``dist_ckpt/.metadata`` from every data file's items (last of the DCP files), then megatron-core's
    ``metadata.json`` and ``common.pt`` (`Writer`)."""
    from merge_engine.formats.torch_dcp_writer import dcp_metadata_bytes

    folder = storage.join(target_url, DIST_DIR)
    out = []
    for name, data in ((METADATA_FILE, dcp_metadata_bytes(item for r in records for item in r.items)),
                       (MEGATRON_METADATA, json.dumps(MEGATRON_DIST_METADATA).encode()),
                       ("common.pt", _torch_saved({}))):
        storage.write_bytes(storage.join(folder, name), data)
        out.append(FileRecord(f"{DIST_DIR}/{name}", len(data), hashlib.sha256(data).hexdigest()))
    return out


LAYOUT = Layout(
    name=NAME,
    tensor_naming=TENSOR_NAMING,
    detect=detect,
    listing_verdict=listing_verdict,
    check_complete=check_complete,
    open=open,
    writer=Writer(config_dir=CONFIG_DIR, file_jobs=file_jobs, write_file=write_file, finish=finish),
)
