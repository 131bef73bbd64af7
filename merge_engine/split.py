"""Hugging Face model -> Megatron shards (the reverse of a merge): ``stepmerge split --to megatron``.

The same family tables drive both directions: `MegatronViewOfHf` gives the canonical Megatron
tensors (QKV merged per query group, gate/up fused, vocabulary padded with zero rows to a
multiple of ``make_vocab_size_divisible_by * tp``), then one of two writers lays them out:

- ``legacy`` (verl's older layout, what ``megatron_legacy`` reads): ``model/mp_rank_TT[_PPP][_EEE]/
  model.pt`` = a list of local-spec state dicts, one per VPP chunk, local layer and expert numbers,
  each rank's TP piece (`merge_engine.architectures.parallel.split_tp`); linear modules carry a
  ``None`` ``_extra_state`` as megatron-core's own ``state_dict()`` has; config and tokenizer in
  ``hf_config_and_tokenizer/``.
- ``dist`` (torch_dist, verl v1's layout, what ``megatron_dist`` reads): ``dist_ckpt/`` with global
  keys, layers stacked on dim 0, one chunk per layer (megatron-core reshards it to any TP/PP on
  load); config and tokenizer in ``huggingface/``.

Both write ``transformer_config.json``: the TransformerConfig / GPTModel values the Megatron model
must be built with to match (sizes, head counts, norm epsilon, RoPE theta, padded vocabulary,
parallel sizes), and ``stepmerge.json`` (provenance) last. The target gets everything or nothing
(`merge_engine.output_target`). Memory: one rank file's tensors, i.e. one TP rank's share of a
pipeline stage (legacy: a rank file is one ``torch.save``), one layer (dist).
"""

from __future__ import annotations

import io
import json
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from merge_engine import __version__, storage
from merge_engine.architectures import model_dims, table_for_config
from merge_engine.architectures.hf_to_megatron import MegatronViewOfHf
from merge_engine.architectures.mappings import GatedMLPMapping
from merge_engine.architectures.megatron_names import EXPERT_NAME, LAYER_NAME, expert_name, layer_name
from merge_engine.architectures.parallel import TPKind, split_tp, tp_kind
from merge_engine.architectures.transforms import padded_vocab_size
from merge_engine.errors import InvalidOption
from merge_engine.hf_metadata import copy_metadata, read_config
from merge_engine.layouts import check_checkpoint, open_checkpoint
from merge_engine.output_target import target_state, write_target
from merge_engine.plan import parse_dtype
from merge_engine.torch_dcp import DcpWriter

FORMATS = ("legacy", "dist")
TRANSFORMER_CONFIG = "transformer_config.json"
LEGACY_HF_DIR = "hf_config_and_tokenizer"
DIST_HF_DIR = "huggingface"
DIST_DIR = "dist_ckpt"
# local-spec modules whose state_dict() has an ``_extra_state`` entry
EXTRA_STATE_MODULES = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "output_layer")
MEGATRON_DIST_METADATA = {"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                          "common_backend": "torch", "common_backend_version": 1}
# canonical (local-spec) layer names -> torch_dist keys (TransformerEngine-style)
_DIST_RENAMES = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
                 "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight"}


@dataclass(frozen=True)
class SplitOptions:
    """The Megatron layout to write."""

    tp: int = 1
    pp: int = 1
    vpp: int | None = None
    ep: int = 1
    fmt: str = "legacy"
    make_vocab_size_divisible_by: int = 128
    dtype: str | None = None  # as stored when None
    custom_mapping: str | None = None
    overwrite: bool = False

    def output_options(self) -> dict[str, Any]:
        return {"tp": self.tp, "pp": self.pp, "vpp": self.vpp, "ep": self.ep, "format": self.fmt,
                "make_vocab_size_divisible_by": self.make_vocab_size_divisible_by, "dtype": self.dtype,
                "custom_mapping": self.custom_mapping}


@dataclass(frozen=True)
class SplitResult:
    source_url: str
    target_url: str
    fmt: str
    files: tuple[tuple[str, int], ...]
    tensors: int
    seconds: float
    skipped: bool = False


def _check_options(options: SplitOptions, view: MegatronViewOfHf) -> None:
    dims = view.dims
    vpp = options.vpp or 1
    problems = []
    if options.fmt not in FORMATS:
        problems.append(f"--format must be one of {FORMATS}")
    if min(options.tp, options.pp, options.ep) < 1:
        problems.append("--tp, --pp and --ep must be >= 1")
    if options.vpp is not None and (options.vpp < 2 or options.pp < 2):
        problems.append("--vpp needs --vpp >= 2 and --pp >= 2")
    if dims.num_layers % (options.pp * vpp):
        problems.append(f"{dims.num_layers} layers do not split into pp x vpp = {options.pp * vpp} equal chunks")
    if dims.num_heads % options.tp:
        problems.append(f"{dims.num_heads} attention heads do not split over TP={options.tp}")
    if options.ep > 1 and (not dims.num_experts or dims.num_experts % options.ep):
        problems.append(f"{dims.num_experts} experts do not split over EP={options.ep}")
    for name, meta in view.metas().items():
        kind = tp_kind(name, _gated(view, name))
        dim = {TPKind.ROW: 1, TPKind.COLUMN: 0, TPKind.GATED_COLUMN: 0}.get(kind)
        parts = options.tp * (2 if kind is TPKind.GATED_COLUMN else 1)
        if dim is not None and options.tp > 1 and meta.shape[dim] % parts:
            problems.append(f"{name} {meta.shape} does not split over TP={options.tp}")
            break
    if problems:
        raise InvalidOption("; ".join(problems))


def _gated(view: MegatronViewOfHf, name: str) -> bool:
    return isinstance(view.binding(name).mapping, GatedMLPMapping)


def _rope_theta(config: Mapping[str, Any]) -> float | None:
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    value = config.get("rope_theta") or (params.get("rope_theta") if isinstance(params, dict) else None)
    return float(value) if value is not None else None


def transformer_config(config: Mapping[str, Any], view: MegatronViewOfHf, options: SplitOptions) -> dict[str, Any]:
    """The Megatron TransformerConfig / GPTModel values the shards must be loaded with."""
    dims = view.dims
    metas = view.metas()
    names = list(metas)
    fc2 = next((m for n, m in metas.items() if n.endswith("mlp.linear_fc2.weight")), None)
    expert_fc2 = next((m for n, m in metas.items() if ".local_experts." in n and n.endswith("linear_fc2.weight")), None)
    shared_fc2 = next((m for n, m in metas.items() if "shared_experts.linear_fc2" in n), None)
    out: dict[str, Any] = {
        "num_layers": dims.num_layers,
        "hidden_size": dims.hidden_size,
        "ffn_hidden_size": int(config.get("intermediate_size") or (fc2.shape[1] if fc2 else 0)),
        "num_attention_heads": dims.num_heads,
        "num_query_groups": dims.num_kv_heads,
        "kv_channels": dims.head_dim,
        "normalization": "RMSNorm",
        "layernorm_epsilon": float(config.get("rms_norm_eps") or config.get("layer_norm_eps") or 1e-5),
        "gated_linear_unit": any(_gated(view, n) for n in names if "linear_fc1" in n),
        "add_bias_linear": False,
        "add_qkv_bias": any(n.endswith("linear_qkv.bias") for n in names),
        "qk_layernorm": any(n.endswith("q_layernorm.weight") for n in names),
        "tensor_model_parallel_size": options.tp,
        "pipeline_model_parallel_size": options.pp,
        "virtual_pipeline_model_parallel_size": options.vpp,
        "expert_model_parallel_size": options.ep,
        # GPTModel arguments
        "vocab_size": dims.vocab_size,
        "padded_vocab_size": dims.padded_vocab_size,
        "make_vocab_size_divisible_by": options.make_vocab_size_divisible_by,
        "share_embeddings_and_output_weights": dims.tied,
        "position_embedding_type": "rope",
        "rotary_base": _rope_theta(config),
        "max_sequence_length": config.get("max_position_embeddings"),
    }
    if dims.num_experts:
        out.update(num_moe_experts=dims.num_experts, moe_ffn_hidden_size=expert_fc2.shape[1] if expert_fc2 else None,
                   moe_router_topk=config.get("num_experts_per_tok"),
                   moe_shared_expert_intermediate_size=shared_fc2.shape[1] if shared_fc2 else None)
    return out


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


def _stage_names(view: MegatronViewOfHf, options: SplitOptions, p: int, e: int) -> list[list[tuple[str, str]]]:
    """Per VPP chunk of stage ``p`` on EP rank ``e``: (name in the rank file, canonical source name),
    in file order. Metadata only."""
    dims = view.dims
    vpp = options.vpp or 1
    per_chunk = dims.num_layers // (options.pp * vpp)
    experts_per_rank = max(1, dims.num_experts // options.ep) if dims.num_experts else 1
    chunks = []
    for v in range(vpp):
        first_layer = (v * options.pp + p) * per_chunk
        layers = range(first_layer, first_layer + per_chunk)
        first, last = p == 0 and v == 0, p == options.pp - 1 and v == vpp - 1
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


def write_legacy(view: MegatronViewOfHf, target_url: str, options: SplitOptions, dtype: torch.dtype | None
                 ) -> list[tuple[str, int]]:
    """``model/mp_rank_*/model.pt`` for every (tp, pp, ep) rank, one rank file at a time.

    A rank file is one ``torch.save``, so its tensors are held while it is built: one TP rank's
    share of one pipeline stage, plus the full tensor being cut. Each tensor is read (and cut)
    once per TP rank rather than all ranks' pieces being held at once.
    """
    written = []
    for p in range(options.pp):
        for e in range(options.ep):
            chunks = _stage_names(view, options, p, e)
            for t in range(options.tp):
                states = [{local: _rank_piece(view, name, t, options.tp, dtype) for local, name in placed}
                          for placed in chunks]
                folder = f"mp_rank_{t:02d}" + (f"_{p:03d}" if options.pp > 1 else "") + (
                    f"_{e:03d}" if options.ep > 1 else "")
                path = f"model/{folder}/model.pt"
                with storage.open_write(storage.join(target_url, path)) as out:
                    torch.save([_with_extra_states(s) for s in states], out)
                del states
                written.append((path, storage.size(storage.join(target_url, path))))
    return written


def _rank_piece(view: MegatronViewOfHf, name: str, rank: int, tp: int, dtype: torch.dtype | None) -> torch.Tensor:
    """TP rank ``rank``'s piece of the canonical tensor ``name``, in its own storage (the full
    tensor it was cut from is freed)."""
    tensor = view.read(name)
    if dtype is not None:
        tensor = tensor.to(dtype)
    piece = split_tp(tensor, tp_kind(name, _gated(view, name)), tp)[rank]
    return piece.clone() if tp > 1 else piece


def _dist_key(name: str, dims) -> tuple[str, tuple[int, ...], tuple[int, ...]]:
    """Canonical name -> (torch_dist key, leading indices, leading global sizes)."""
    match = LAYER_NAME.match(name)
    if not match:
        return name, (), ()
    layer, rest = int(match.group(1)), match.group(2)
    expert = EXPERT_NAME.match(rest)
    if expert:
        return (f"decoder.layers.mlp.experts.experts.{expert.group(2)}", (layer, int(expert.group(1))),
                (dims.num_layers, dims.num_experts))
    return f"decoder.layers.{_DIST_RENAMES.get(rest, rest)}", (layer,), (dims.num_layers,)


def write_dist(view: MegatronViewOfHf, target_url: str, dtype: torch.dtype | None) -> list[tuple[str, int]]:
    """``dist_ckpt/``: torch_dist keys, one DCP chunk per layer (and expert), extra states as bytes."""
    dims = view.dims
    folder = storage.join(target_url, DIST_DIR)
    writer = DcpWriter(folder)
    none_bytes = io.BytesIO()
    torch.save([None], none_bytes)  # megatron-core saves a ShardedObject as a one-item list
    extra_states = set()
    try:
        for name, meta in view.metas().items():
            key, lead, lead_sizes = _dist_key(name, dims)
            tensor = view.read(name)
            if dtype is not None:
                tensor = tensor.to(dtype)
            writer.add_chunk(key, (*lead_sizes, *meta.shape), (*lead, *(0,) * len(meta.shape)),
                             tensor.reshape((1,) * len(lead) + tuple(meta.shape)))
            module, _, leaf = key.rpartition(".")
            if lead and leaf == "weight" and module.rsplit(".", 1)[-1] in EXTRA_STATE_MODULES:
                shard = ".".join(map(str, lead)) + "_" + ".".join(map(str, lead_sizes))
                extra = f"{module}._extra_state/shard_{shard}"
                if extra not in extra_states:
                    extra_states.add(extra)
                    writer.add_object(extra, none_bytes.getvalue())
        names = writer.close()
    except BaseException:
        writer.abort()
        raise
    storage.write_bytes(storage.join(folder, "metadata.json"), json.dumps(MEGATRON_DIST_METADATA).encode())
    common = io.BytesIO()
    torch.save({}, common)
    storage.write_bytes(storage.join(folder, "common.pt"), common.getvalue())
    files = [*names, "metadata.json", "common.pt"]
    return [(f"{DIST_DIR}/{n}", storage.size(storage.join(folder, n))) for n in files]


def split_hf_to_megatron(hf_url: str, target_url: str, options: SplitOptions = SplitOptions()) -> SplitResult:
    """Write the Hugging Face model at ``hf_url`` as Megatron shards at ``target_url`` (see module docstring).

    Errors: `InvalidOption` (sizes that do not split), `MappingError` (a tensor the table does not
    know, or one the config implies missing), `UnknownArchitecture`, `TargetExists`; nothing is
    left at the target on any error.
    """
    started = time.perf_counter()
    checkpoint = check_checkpoint(hf_url, "hf")
    config = read_config(hf_url, what="Hugging Face model")
    fingerprint = storage.fingerprint(checkpoint.files, **options.output_options(), engine=__version__, kind="split")
    state = target_state(target_url, fingerprint, options.overwrite)
    if state == "same":
        return SplitResult(hf_url, target_url, options.fmt, tuple((e.path, e.size) for e in
                                                                   storage.list_files(target_url)), 0,
                           time.perf_counter() - started, skipped=True)
    dtype = parse_dtype(options.dtype)
    table = table_for_config(config, options.custom_mapping)
    scope = config.get("text_config") or config
    dims = model_dims(config, table, padded_vocab_size=padded_vocab_size(
        int(scope["vocab_size"]), options.tp, options.make_vocab_size_divisible_by))
    view = MegatronViewOfHf(open_checkpoint(checkpoint), table, config, dims)
    try:
        _check_options(options, view)
        view.check_tied_copies()
        megatron_config = transformer_config(config, view, options)

        def write(url: str) -> list[tuple[str, int]]:
            if options.fmt == "legacy":
                files = write_legacy(view, url, options, dtype)
                files += [(f"{LEGACY_HF_DIR}/{n}", s) for n, s in copy_metadata(hf_url, storage.join(url, LEGACY_HF_DIR),
                                                                                  config)]
            else:
                files = write_dist(view, url, dtype)
                files += [(f"{DIST_HF_DIR}/{n}", s) for n, s in copy_metadata(hf_url, storage.join(url, DIST_HF_DIR),
                                                                                config)]
            data = (json.dumps(megatron_config, indent=2, sort_keys=True) + "\n").encode()
            storage.write_bytes(storage.join(url, TRANSFORMER_CONFIG), data)
            files.append((TRANSFORMER_CONFIG, len(data)))
            return files

        files = write_target(target_url, state, write, {
            "source": hf_url, "fingerprint": fingerprint, "engine_version": __version__, "kind": "megatron split",
            "options": options.output_options(), "tensors": len(view.metas())})
    finally:
        view.close()
    return SplitResult(hf_url, target_url, options.fmt, tuple(files), len(view.metas()), time.perf_counter() - started)
