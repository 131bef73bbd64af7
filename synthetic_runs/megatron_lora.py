"""verl Megatron LoRA steps (verl 0.9.1 + Megatron-Bridge PEFT) from known factors: a writer of our own.

Why our own: Megatron-Bridge does not run here. Its releases for Python 3.11 (<= 0.3.1) import
``transformer_engine`` (CUDA) in ``megatron.bridge.peft.lora_layers`` and pin ``transformers<5``;
0.4+ needs Python 3.12 (megatron-core 0.16.1 is the last that runs here). So this module writes the
files as their code does (read from NVIDIA-NeMo/Megatron-Bridge ``peft/utils.py``
``ParallelLinearAdapter`` + ``sharded_state_dict``, ``models/conversion/peft_bridge.py``
``convert_adapter_weights_to_peft_state`` / ``build_adapter_config_dict``, ``auto_bridge.save_hf_adapter``,
and verl's ``MegatronCheckpointManager.save_checkpoint`` / ``_build_checkpoint_manifest``):

- ``model/dist_ckpt/`` (torch_dist): per TP / PP / EP rank, the LOCAL factors at their global offsets.
  ``linear_in`` of a column-parallel base (``linear_qkv``, ``linear_fc1``) is a ColumnParallelLinear
  (r split over TP, axis 0); of a row-parallel base (``linear_proj``, ``linear_fc2``) a RowParallelLinear
  (input split, axis 1). ``linear_out`` is a ColumnParallelLinear (output rows split over TP); for
  SwiGLU ``linear_fc1`` through megatron-core's swiglu factory (rank t's [gate_t; up_t] stored at
  gate offset t and up offset tp + t of 2 tp fragments). Grouped experts: ONE adapter per EP rank,
  shared by its local experts, exposed with the global expert axis (``_apply_expert_axis_factory``);
  expert TP is 1. Layers stacked on dim 0 (PP stages write their range).
  ``use_dist_checkpointing: true``: the base weights too (written by ``stepmerge split --format dist``,
  the path `tests/merge_engine/commands/test_split.py` checks against megatron-core), in the same folder.
- ``model/huggingface/`` config + tokenizer, and ``adapter/`` as ``save_hf_adapter`` writes it:
  ``base_model.model.<hf module>.lora_A.weight`` (A duplicated over q/k/v and gate/up, B cut),
  per-expert names ``mlp.experts.E.gate_proj`` (the Hub names the bridge maps experts to), and
  adapter_config.json from ``build_adapter_config_dict`` (``target_modules`` = the modules' last names).
- ``ckpt_contents.json`` last (tmp + replace), with verl's ``contents`` for each setting.

The truth (`LoraStep.factors`: canonical Megatron names -> global factors, and ``hf_factors``) is
drawn from seeded generators; ``hf_factors`` is computed by a straightforward loop here, not by
stepmerge's tables. `reference_fused_state` = base + (alpha / r) B @ A per Hugging Face weight.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save_file

from synthetic_runs.models import ModelSpec, build_config, build_model, write_hf_metadata

PEFT_PREFIX = "base_model.model."


@dataclass(frozen=True)
class LoraRunSpec:
    model: ModelSpec
    tp: int = 1
    pp: int = 1
    ep: int = 1
    use_dist_checkpointing: bool = False
    peft_folder: bool = True  # False: a run whose bridge export is missing (adapter in dist_ckpt only)
    r: int = 4
    alpha: float = 8.0

    @property
    def moe(self) -> bool:
        return self.model.family in ("qwen3_moe",)


@dataclass
class LoraStep:
    step_dir: Path
    spec: LoraRunSpec
    base_dir: Path
    factors: dict[str, torch.Tensor] = field(default_factory=dict)  # canonical Megatron name -> factor
    hf_factors: dict[str, torch.Tensor] = field(default_factory=dict)  # adapter-file key -> factor


def _dims(spec: LoraRunSpec) -> dict[str, int]:
    config = build_config(spec.model)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return {"hidden": config.hidden_size, "heads": config.num_attention_heads,
            "kv": config.num_key_value_heads, "head_dim": head_dim, "layers": config.num_hidden_layers,
            "ffn": getattr(config, "moe_intermediate_size", None) if spec.moe else config.intermediate_size,
            "experts": getattr(config, "num_experts", 0) if spec.moe else 0}


def _draw(name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{name}".encode()))
    return torch.randn(shape, generator=generator) * 0.05


# module -> (column-parallel base?, in features, out rows)
def _modules(spec: LoraRunSpec) -> dict[str, tuple[bool, str, str]]:
    mlp = "mlp.experts.linear_fc" if spec.moe else "mlp.linear_fc"
    return {"self_attention.linear_qkv": (True, "hidden", "qkv"), "self_attention.linear_proj": (False, "attn", "hidden"),
            f"{mlp}1": (True, "hidden", "fc1"), f"{mlp}2": (False, "ffn", "hidden")}


def megatron_factors(spec: LoraRunSpec, seed: int) -> dict[str, torch.Tensor]:
    """Canonical per-layer factors ``decoder.layers.N.<module>.adapter.linear_{in,out}.weight``; grouped
    experts ``[experts, ...]``, equal within an EP rank (one shared adapter per EP rank)."""
    d, r = _dims(spec), spec.r
    size = {"hidden": d["hidden"], "attn": d["heads"] * d["head_dim"], "ffn": d["ffn"],
            "qkv": (d["heads"] + 2 * d["kv"]) * d["head_dim"], "fc1": 2 * d["ffn"]}
    out = {}
    for layer in range(d["layers"]):
        for module, (_, fan_in, rows) in _modules(spec).items():
            base = f"decoder.layers.{layer}.{module}.adapter"
            shapes = {"linear_in": (r, size[fan_in]), "linear_out": (size[rows], r)}
            for side, shape in shapes.items():
                if ".experts." in module:
                    local = d["experts"] // spec.ep
                    per_rank = [_draw(f"{base}.{side}.ep{e}", shape, seed) for e in range(spec.ep)]
                    out[f"{base}.{side}.weight"] = torch.stack([per_rank[x // local] for x in range(d["experts"])])
                else:
                    out[f"{base}.{side}.weight"] = _draw(f"{base}.{side}", shape, seed)
    return out


def _hf_parts(module: str, layer: int, d: dict[str, int], b: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """(HF module, B rows) of a Megatron module's linear_out, by a plain loop."""
    prefix = f"model.layers.{layer}"
    if module.endswith("linear_qkv"):
        per_group, hd = d["heads"] // d["kv"], d["head_dim"]
        q, k, v = [], [], []
        for group in range(d["kv"]):
            start = group * (per_group + 2) * hd
            q.append(b[start:start + per_group * hd])
            k.append(b[start + per_group * hd:start + (per_group + 1) * hd])
            v.append(b[start + (per_group + 1) * hd:start + (per_group + 2) * hd])
        return [(f"{prefix}.self_attn.q_proj", torch.cat(q)), (f"{prefix}.self_attn.k_proj", torch.cat(k)),
                (f"{prefix}.self_attn.v_proj", torch.cat(v))]
    if module.endswith("linear_proj"):
        return [(f"{prefix}.self_attn.o_proj", b)]
    if module.endswith("linear_fc1"):
        half = b.shape[0] // 2
        return [("gate_proj", b[:half]), ("up_proj", b[half:])]
    return [("down_proj", b)]


def hf_factors(spec: LoraRunSpec, factors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapter file ``save_hf_adapter`` writes for these factors (Hub names, per expert)."""
    d = _dims(spec)
    out = {}
    for layer in range(d["layers"]):
        for module in _modules(spec):
            base = f"decoder.layers.{layer}.{module}.adapter"
            a, b = factors[f"{base}.linear_in.weight"], factors[f"{base}.linear_out.weight"]
            experts = range(d["experts"]) if ".experts." in module else [None]
            for expert in experts:
                a_e, b_e = (a, b) if expert is None else (a[expert], b[expert])
                for name, rows in _hf_parts(module, layer, d, b_e):
                    if not name.startswith("model."):
                        mlp = f"model.layers.{layer}.mlp" + (f".experts.{expert}" if expert is not None else "")
                        name = f"{mlp}.{name}"
                    out[f"{PEFT_PREFIX}{name}.lora_A.weight"] = a_e.clone()
                    out[f"{PEFT_PREFIX}{name}.lora_B.weight"] = rows.clone()
    return out


def _dist_key(name: str) -> tuple[str, int]:
    """Canonical per-layer name -> (stacked torch_dist key, layer)."""
    rest = name[len("decoder.layers."):]
    layer, local = rest.split(".", 1)
    return f"decoder.layers.{local}", int(layer)


def _rank_chunks(spec: LoraRunSpec, name: str, tensor: torch.Tensor, tp_rank: int, ep_rank: int
                 ) -> list[tuple[tuple[int, ...], torch.Tensor]]:
    """(offsets within the per-layer global tensor, local chunk) that (tp_rank, ep_rank) saves, as
    Megatron-Bridge's ParallelLinearAdapter.sharded_state_dict lays them out (replica 0 only)."""
    module = name.split(".adapter.")[0].split(".", 3)[3]
    side = "linear_in" if name.endswith("linear_in.weight") else "linear_out"
    column_base = _modules(spec)[module][0]
    if ".experts." in module:  # expert TP 1; EP rank holds its experts; TP ranks > 0 are replicas
        if tp_rank:
            return []
        local = tensor.shape[0] // spec.ep
        return [((ep_rank * local, 0, 0), tensor[ep_rank * local:(ep_rank + 1) * local])]
    if ep_rank:
        return []
    tp = spec.tp
    if side == "linear_in":
        axis = 0 if column_base else 1
    else:
        axis = 0
    if side == "linear_out" and module.endswith("linear_fc1"):
        half = tensor.shape[0] // 2
        size = half // tp
        gate = tensor[tp_rank * size:(tp_rank + 1) * size]
        up = tensor[half + tp_rank * size:half + (tp_rank + 1) * size]
        return [((tp_rank * size, 0), gate), ((half + tp_rank * size, 0), up)]
    size = tensor.shape[axis] // tp
    chunk = tensor.narrow(axis, tp_rank * size, size)
    offsets = [0, 0]
    offsets[axis] = tp_rank * size
    return [(tuple(offsets), chunk)]


def write_adapter_dist(folder: Path, spec: LoraRunSpec, factors: dict[str, torch.Tensor]) -> list:
    """Each (pp, tp, ep) rank's adapter chunks into its own data file; returns the DCP items."""
    from merge_engine.formats.torch_dcp_writer import DcpDataFile

    d = _dims(spec)
    per_stage = d["layers"] // spec.pp
    items = []
    for pp_rank in range(spec.pp):
        layers = range(pp_rank * per_stage, (pp_rank + 1) * per_stage)
        for tp_rank in range(spec.tp):
            for ep_rank in range(spec.ep):
                rank = (pp_rank * spec.tp + tp_rank) * spec.ep + ep_rank
                with DcpDataFile(str(folder), f"__adapter{rank}_0.distcp") as data:
                    for name, tensor in factors.items():
                        key, layer = _dist_key(name)
                        if layer not in layers:
                            continue
                        for offsets, chunk in _rank_chunks(spec, name, tensor, tp_rank, ep_rank):
                            data.add_chunk(key, (d["layers"], *tensor.shape), (layer, *offsets),
                                           chunk.unsqueeze(0))
                items.extend(data.items)
    return items


def _contents(spec: LoraRunSpec, step: int) -> dict:
    if spec.use_dist_checkpointing:
        contents = {"model": {"path": "model/dist_ckpt", "format": "megatron_dist_checkpoint",
                              "backend": "dist_checkpointing"}}
    else:
        model = {"path": "model/huggingface", "format": "huggingface", "backend": "mbridge"}
        if spec.peft_folder:
            model["peft_adapter_path"] = "model/huggingface/adapter"
        contents = {"model": model,
                    "peft_adapters": {"path": "model/dist_ckpt", "format": "megatron_dist_checkpoint",
                                      "note": "PEFT adapter shards sit next to base-model HF weights, under "
                                              "model/dist_ckpt/."},
                    "hf_config": {"path": "model/huggingface", "format": "huggingface"},
                    "tokenizer": {"path": "model/huggingface", "format": "huggingface"}}
    contents["transformer_config"] = {"path": "transformer_config.json", "format": "json"}
    return {"schema_version": 2, "framework": "megatron", "role": "actor", "arch": spec.model.architecture,
            "global_step": step, "world_size": spec.tp * spec.pp * max(1, spec.ep),
            "backend": {"has_bridge": True, "use_dist_checkpointing": spec.use_dist_checkpointing, "peft": True},
            "save_contents": ["model", "extra"], "contents": contents, "directories": {},
            "saved_any_dist_ckpt": True}


def write_base(base_dir: Path, model: ModelSpec, seed: int) -> Path:
    """The base model the run trained from, a Hugging Face folder (what the user names with --base-model)."""
    if not (base_dir / "config.json").exists():
        build_model(model, seed).save_pretrained(base_dir)
        write_hf_metadata(base_dir, model)
    return base_dir


def write_lora_step(step_dir: Path, spec: LoraRunSpec, base_dir: Path, seed: int = 0, step: int = 1) -> LoraStep:
    """One verl Megatron LoRA step at ``step_dir`` (``.../global_step_N/actor``) for the base at ``base_dir``."""
    from merge_engine.layouts.megatron_dist import MEGATRON_DIST_METADATA
    from merge_engine.formats.torch_dcp_writer import dcp_metadata_bytes

    factors = megatron_factors(spec, seed)
    hf = hf_factors(spec, factors)
    dist = step_dir / "model" / "dist_ckpt"
    dist.mkdir(parents=True)
    items = write_adapter_dist(dist, spec, factors)
    metadata = dcp_metadata_bytes(items)
    if spec.use_dist_checkpointing:
        metadata = _with_base(dist, spec, base_dir, metadata)
    else:
        write_hf_metadata(step_dir / "model" / "huggingface", spec.model)
        if spec.peft_folder:
            adapter = step_dir / "model" / "huggingface" / "adapter"
            adapter.mkdir()
            config = {"peft_type": "LORA", "auto_mapping": None, "base_model_name_or_path": str(base_dir),
                      "bias": "none", "fan_in_fan_out": False, "inference_mode": True, "init_lora_weights": True,
                      "lora_alpha": spec.alpha, "lora_dropout": 0.0, "modules_to_save": None, "r": spec.r,
                      "rank_pattern": {}, "alpha_pattern": {},
                      "target_modules": sorted({k[:-len(".lora_A.weight")].rsplit(".", 1)[-1]
                                                for k in hf if k.endswith(".lora_A.weight")}),
                      "task_type": "CAUSAL_LM", "use_dora": False, "use_rslora": False}
            (adapter / "adapter_config.json").write_text(json.dumps(config, indent=2))
            save_file({k: v.contiguous() for k, v in hf.items()}, str(adapter / "adapter_model.safetensors"))
    (dist / ".metadata").write_bytes(metadata)
    (dist / "metadata.json").write_text(json.dumps(MEGATRON_DIST_METADATA))
    torch.save({}, dist / "common.pt")
    (step_dir / "transformer_config.json").write_text(json.dumps(
        {"tensor_model_parallel_size": spec.tp, "pipeline_model_parallel_size": spec.pp,
         "expert_model_parallel_size": spec.ep, "expert_tensor_parallel_size": 1}))
    marker = step_dir / "ckpt_contents.json"
    tmp = marker.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(_contents(spec, step), indent=2, sort_keys=True))
    os.replace(tmp, marker)
    return LoraStep(step_dir, spec, base_dir, factors, hf)


def _with_base(dist: Path, spec: LoraRunSpec, base_dir: Path, adapter_metadata: bytes) -> bytes:
    """The base's torch_dist files (``stepmerge split --format dist``) moved into ``dist``; the
    ``.metadata`` of base and adapter together."""
    import pickle

    from merge_engine.output.jobs import OutputOptions
    from merge_engine.commands.split import split_hf_to_megatron

    scratch = Path(tempfile.mkdtemp(prefix="lora-base-"))
    try:
        split_hf_to_megatron(str(base_dir), str(scratch / "out"),
                             OutputOptions(format="dist", tp=spec.tp, pp=spec.pp, ep=spec.ep))
        for item in (scratch / "out" / "dist_ckpt").iterdir():
            if item.name.endswith(".distcp"):
                shutil.move(str(item), dist / item.name)
        base = pickle.loads((scratch / "out" / "dist_ckpt" / ".metadata").read_bytes())
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    adapter = pickle.loads(adapter_metadata)
    base.state_dict_metadata.update(adapter.state_dict_metadata)
    base.storage_data.update(adapter.storage_data)
    return pickle.dumps(base)


def reference_fused_state(step: LoraStep) -> dict[str, torch.Tensor]:
    """The trained model: every base weight + (alpha / r) B @ A, from the Hugging Face factors (fp32)."""
    from safetensors.torch import load_file

    state = {}
    for file in sorted(step.base_dir.glob("*.safetensors")):
        state.update(load_file(str(file)))
    scale = step.spec.alpha / step.spec.r
    for key, a in step.hf_factors.items():
        if not key.endswith(".lora_A.weight"):
            continue
        module = key[len(PEFT_PREFIX):-len(".lora_A.weight")]
        b = step.hf_factors[key.replace("lora_A", "lora_B")]
        state[f"{module}.weight"] = state[f"{module}.weight"] + scale * (b @ a)
    return state
