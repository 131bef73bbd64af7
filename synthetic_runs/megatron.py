"""Real Megatron checkpoints, written by megatron-core GPTModels on CPU, with their reference weights.

Test-only (megatron-core is a test dependency; ``merge_engine`` never imports this module). The
module itself imports only torch/safetensors/transformers; megatron-core is imported inside the
spawned gloo workers.

How "the same weights" is guaranteed
------------------------------------
1. ``reference_state_dict(spec, seed)`` draws the FULL weights once, in the names and layout a
   TP=PP=EP=1 local-spec GPTModel holds (global layer numbers, padded vocabulary), each tensor from
   its own generator seeded by ``(seed, name)``.
2. Every rank of a real gloo world builds its GPTModel chunks and loads ITS slice of that reference
   (``rank_state_dict``) with ``load_state_dict(strict=True)``.
3. Before anything is written, every rank checks each tensor it holds against the reference slice
   that megatron-core's OWN sharding metadata (``sharded_state_dict()``: global shape, global
   offset, swiglu factories, expert offsets) says it holds. A slicing mistake here fails the fixture,
   so the reference is provably the numbers the ranks hold, by megatron's definition.
4. The files are then written from the live models (``state_dict()`` / ``sharded_state_dict()`` +
   ``dist_checkpointing.save``), and the logits come from a real megatron-core forward pass.
The Hugging Face oracle (``reference_to_hf``) is a separate, straightforward conversion; it is
checked by comparing transformers logits with the megatron-core logits (test file).

Layouts written (``MegatronSpec.fmt``; ``step_dir`` is ``.../global_step_N`` for verl formats and
``.../iter_NNNNNNN`` for ``megatron_lm*``; the run root gets ``latest_checkpointed_iteration.txt``):
- ``legacy``      ``actor/model/mp_rank_TT[_PPP][_EEE]/model.pt`` (list of chunk state dicts, local
                  layer numbers) + ``actor/hf_config_and_tokenizer/`` (older verl).
- ``megatron_lm`` ``mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt`` = {args, checkpoint_version,
                  iteration, model | model0.., rng_state, num_floating_point_operations_so_far}.
- ``megatron_lm_dist`` Megatron-LM's default ``--ckpt-format torch_dist``: the torch_dist files
                  directly in ``iter_NNNNNNN/``; ``common.pt`` holds args (argparse.Namespace),
                  checkpoint_version, iteration, content_metadata.
- ``dist_v1``     ``actor/dist_ckpt/`` (torch_dist: model + rng_state) + ``actor/huggingface/``
                  (config + tokenizer, no weights) + ``actor/transformer_config.json``.
- ``dist_v2``     ``actor/model/dist_ckpt/``, ``actor/extra/dist_ckpt/`` (rng_state),
                  ``actor/model/huggingface/`` (config + tokenizer), ``actor/transformer_config.json``,
                  ``actor/ckpt_contents.json`` written LAST (tmp + fsync + replace, verl 0.9 schema 2).
- ``bridge_v2``   verl 0.9's default (mbridge): the weights only in ``actor/model/huggingface/`` as
                  2 safetensors shards + index (the HF oracle of these models), no model/dist_ckpt,
                  ``actor/extra/dist_ckpt/`` (rng only), transformer_config.json, ckpt_contents.json.

The gloo world: ``write_megatron_steps`` runs every job in ONE world (default 4 processes; a job
needing fewer runs with the others as data-parallel replicas, so DP > 1 files appear as in real
runs), forked from a forkserver that imported megatron-core once, rendezvous through a file (no
ports). CPU stand-ins for megatron-core's CUDA calls live in ``synthetic_runs.megatron_shims``.

Not produced: optimizer state (no megatron optimizer is built), bf16 parameters (fp32 only),
TransformerEngine modules (CUDA only: the local spec is used; ``legacy_names="te"`` renames legacy
keys as a TE model has them, and torch_dist keys are TE-style already).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import tempfile
import time
import zlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3", "glm4_moe")
FORMATS = ("legacy", "megatron_lm", "megatron_lm_dist", "dist_v1", "dist_v2", "bridge_v2")
RANK_FILE_FORMATS = ("legacy", "megatron_lm")
DIST_FORMATS = ("megatron_lm_dist", "dist_v1", "dist_v2")
LEGACY_NAMES = ("local", "te")

REFERENCE_STATE_FILE = "megatron_state.safetensors"
REFERENCE_HF_DIR = "hf"
REFERENCE_INPUT_IDS_FILE = "input_ids.pt"
REFERENCE_LOGITS_FILE = "logits.pt"
TRACKER_FILE = "latest_checkpointed_iteration.txt"
MAX_POSITIONS = 128
_SEQ_LEN = 12


# --------------------------------------------------------------------------------------------------
# Spec and model families
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Family:
    """What a model family changes in the Megatron config and the Hugging Face config."""

    model_type: str
    architecture: str
    qkv_bias: bool = False
    qk_norm: bool = False
    moe: bool = False
    shared_expert: bool = False  # a shared expert beside the routed ones
    shared_expert_gate: bool = False  # ... scaled by a sigmoid gate (Qwen2-MoE)
    mla: bool = False  # multi-latent attention with q / kv low-rank projections and their norms (DeepSeek)
    router_sigmoid: bool = False  # sigmoid scores + a routing-only expert bias, top-k renormalised (DeepSeek)
    rotary_percent: float = 1.0  # share of each head's dims that RoPE rotates (GLM-4.5: half)
    router_pre_softmax: bool = False  # softmax over all experts, then top-k, no renormalisation
    rope_theta: float = 1_000_000.0
    norm_eps: float = 1e-6
    head_dim_override: bool = False  # transformers honours config.head_dim != hidden/heads


_FAMILY_TABLE: dict[str, _Family] = {
    "llama": _Family("llama", "LlamaForCausalLM", rope_theta=500_000.0, norm_eps=1e-5, head_dim_override=True),
    "qwen2": _Family("qwen2", "Qwen2ForCausalLM", qkv_bias=True),
    "qwen3": _Family("qwen3", "Qwen3ForCausalLM", qk_norm=True, head_dim_override=True),
    "mistral": _Family("mistral", "MistralForCausalLM", norm_eps=1e-5, head_dim_override=True),
    "mixtral": _Family("mixtral", "MixtralForCausalLM", moe=True, norm_eps=1e-5),
    "qwen2_moe": _Family(
        "qwen2_moe", "Qwen2MoeForCausalLM", qkv_bias=True, moe=True, shared_expert=True, shared_expert_gate=True,
        router_pre_softmax=True
    ),
    # rope_theta 10000: MLA takes its own rotary base (MLATransformerConfig.rotary_base)
    "deepseek_v3": _Family("deepseek_v3", "DeepseekV3ForCausalLM", moe=True, shared_expert=True, mla=True,
                           router_sigmoid=True, rope_theta=10_000.0),
    "qwen3_moe": _Family("qwen3_moe", "Qwen3MoeForCausalLM", qk_norm=True, moe=True, head_dim_override=True),
    # GLM-4.5: GQA with q/k/v bias (+ optional q/k norms), half-rotary RoPE, DeepSeek-style MoE
    "glm4_moe": _Family("glm4_moe", "Glm4MoeForCausalLM", qkv_bias=True, qk_norm=True, moe=True, shared_expert=True,
                        router_sigmoid=True, rotary_percent=0.5, norm_eps=1e-5, head_dim_override=True),
}


# Multi-latent attention sizes of the tiny DeepSeek-V3 fixtures (q/kv low-rank ranks, head dims)
MLA_DIMS = {"q_lora_rank": 32, "kv_lora_rank": 24, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16}
ROUTED_SCALING_FACTOR = 2.5  # DeepSeek's routed_scaling_factor (megatron: moe_router_topk_scaling_factor)


@dataclass(frozen=True)
class MegatronSpec:
    """One Megatron checkpoint to write: model family and sizes, parallel layout, on-disk format.

    MoE families get ``num_experts=4``, ``moe_ffn_hidden_size=48`` (and Qwen2-MoE
    ``shared_expert_size=64``) when left ``None``. ``head_dim`` defaults to hidden/heads.
    ``moe_layer_freq`` (MoE families): megatron-core's list pattern, 1 = MoE layer, 0 = dense
    layer of ``ffn_hidden_size`` (first dense layers, ``mlp_only_layers``); None = every layer MoE.
    Mixed layers make megatron-core store every layer under its own torch_dist key
    (``decoder.layers.3.mlp.experts.experts.linear_fc1.weight`` = [experts, ...]).
    ``legacy_names="te"`` writes ``legacy`` / ``megatron_lm`` files with the key names a
    TransformerEngine-spec model (what verl uses on GPUs) would have; see ``te_legacy_name``.
    Invalid combinations raise ``ValueError`` at construction.
    """

    family: str = "llama"
    tp: int = 1
    pp: int = 1
    vpp: int | None = None
    ep: int = 1
    vocab_size: int = 1003
    hidden_size: int = 64
    ffn_hidden_size: int = 112
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    tie_word_embeddings: bool = False
    num_experts: int | None = None
    moe_ffn_hidden_size: int | None = None
    shared_expert_size: int | None = None
    fmt: str = "legacy"
    head_dim: int | None = None
    moe_topk: int = 2
    make_vocab_size_divisible_by: int = 128
    legacy_names: str = "local"
    moe_layer_freq: tuple[int, ...] | None = None  # per layer: 1 MoE, 0 dense (megatron's list form)
    mtp_layers: int = 0  # DeepSeek multi-token-prediction layers (megatron-core mtp_num_layers)

    def __post_init__(self) -> None:
        if self.family not in _FAMILY_TABLE:
            raise ValueError(f"unknown family {self.family!r}; supported: {', '.join(FAMILIES)}")
        fam = _FAMILY_TABLE[self.family]
        if fam.moe:
            if self.num_experts is None:
                object.__setattr__(self, "num_experts", 4)
            if self.moe_ffn_hidden_size is None:
                object.__setattr__(self, "moe_ffn_hidden_size", 48)
            if fam.shared_expert and self.shared_expert_size is None:
                # DeepSeek: n_shared_experts experts of moe_ffn_hidden_size
                object.__setattr__(self, "shared_expert_size",
                                   self.moe_ffn_hidden_size if fam.router_sigmoid else 64)
        problems = self._problems(fam)
        if problems:
            raise ValueError(f"invalid MegatronSpec {self}: " + "; ".join(problems))

    def _problems(self, fam: _Family) -> list[str]:
        p: list[str] = []
        if self.fmt not in FORMATS:
            p.append(f"fmt must be one of {FORMATS}")
        if self.legacy_names not in LEGACY_NAMES:
            p.append(f"legacy_names must be one of {LEGACY_NAMES}")
        elif self.legacy_names == "te" and self.fmt not in RANK_FILE_FORMATS:
            p.append("legacy_names='te' applies to per-rank files only (torch_dist keys are TE-style already)")
        if min(self.tp, self.pp, self.ep) < 1:
            p.append("tp, pp, ep must be >= 1")
        if self.num_heads % self.num_kv_heads:
            p.append("num_heads must be a multiple of num_kv_heads")
        if self.num_heads % self.tp:
            p.append("num_heads must be a multiple of tp")
        if self.num_kv_heads % self.tp and self.tp % self.num_kv_heads:
            p.append("num_kv_heads must be a multiple or a divisor of tp (megatron-core rule)")
        if self.ffn_hidden_size % self.tp:
            p.append("ffn_hidden_size must be a multiple of tp")
        if self.vpp is not None and (self.vpp < 2 or self.pp < 2):
            p.append("vpp needs vpp >= 2 and pp >= 2 (interleaved schedule)")
        if self.num_layers % (self.pp * (self.vpp or 1)):
            p.append("num_layers must be a multiple of pp * vpp")
        if self.head_dim is not None and self.head_dim != self.hidden_size // self.num_heads:
            if not fam.head_dim_override:
                p.append(f"family {self.family} cannot have head_dim != hidden_size / num_heads in transformers")
        if fam.moe:
            assert self.num_experts is not None and self.moe_ffn_hidden_size is not None
            if self.num_experts % self.ep:
                p.append("num_experts must be a multiple of ep")
            if self.moe_ffn_hidden_size % self.tp:
                p.append("moe_ffn_hidden_size must be a multiple of tp")
            if self.moe_topk > self.num_experts:
                p.append("moe_topk must be <= num_experts")
            if self.moe_layer_freq is not None:
                if len(self.moe_layer_freq) != self.num_layers or set(self.moe_layer_freq) - {0, 1}:
                    p.append("moe_layer_freq needs one 0 (dense) or 1 (MoE) per layer")
                if fam.model_type == "mixtral" and 0 in self.moe_layer_freq:
                    p.append("transformers' Mixtral has no dense layers")
                if fam.router_sigmoid and list(self.moe_layer_freq) != sorted(self.moe_layer_freq):
                    p.append("DeepSeek's / GLM's dense layers are the first ones (first_k_dense_replace)")
        if not fam.moe:
            if self.num_experts is not None or self.moe_ffn_hidden_size is not None or self.ep != 1:
                p.append(f"dense family {self.family} takes no experts and ep=1")
            if self.moe_layer_freq is not None:
                p.append(f"dense family {self.family} takes no moe_layer_freq")
        if fam.mla:
            if self.num_kv_heads != self.num_heads:
                p.append("MLA has one key and value per head: num_kv_heads must equal num_heads")
            if self.legacy_names == "te":
                p.append("TE names of MLA modules are not written (local spec names only)")
        if fam.router_sigmoid and (self.shared_expert_size is None
                                   or self.shared_expert_size % (self.moe_ffn_hidden_size or 1)):
            p.append("DeepSeek's / GLM's shared expert size is n_shared_experts * moe_ffn_hidden_size")
        if self.shared_expert_size is not None and not fam.shared_expert:
            p.append(f"family {self.family} has no shared expert")
        if self.mtp_layers and (not fam.mla or self.vpp):
            p.append("MTP layers are written for DeepSeek-V3 without VPP")
        return p

    @property
    def family_info(self) -> _Family:
        return _FAMILY_TABLE[self.family]

    @property
    def is_moe(self) -> bool:
        return self.family_info.moe

    def is_moe_layer(self, layer: int) -> bool:
        return self.is_moe and (self.moe_layer_freq is None or bool(self.moe_layer_freq[layer]))

    @property
    def mixed_layers(self) -> bool:
        """Some layers dense, some MoE: megatron-core then keys every layer on its own in torch_dist."""
        return self.is_moe and self.moe_layer_freq is not None and len(set(self.moe_layer_freq)) > 1

    @property
    def dense_layers(self) -> list[int]:
        return [i for i in range(self.num_layers) if not self.is_moe_layer(i)]

    @property
    def world_size(self) -> int:
        """Processes one copy of the model needs: tp * pp * ep (expert TP = tp, DP = ep)."""
        return self.tp * self.pp * self.ep

    @property
    def kv_channels(self) -> int:
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_heads

    @property
    def padded_vocab_size(self) -> int:
        """Megatron-LM's rule: round up to a multiple of make_vocab_size_divisible_by * tp."""
        multiple = self.make_vocab_size_divisible_by * self.tp
        return int(math.ceil(self.vocab_size / multiple) * multiple)

    @property
    def vpp_size(self) -> int:
        return self.vpp or 1

    @property
    def layers_per_chunk(self) -> int:
        return self.num_layers // (self.pp * self.vpp_size)


def layer_range(spec: MegatronSpec, pp_rank: int, vpp_rank: int = 0) -> range:
    """Global layer numbers held by model chunk ``vpp_rank`` of pipeline stage ``pp_rank``.

    Interleaved schedule: chunk v of stage p holds layers starting at (v * pp + p) * L / (pp * vpp).
    """
    start = (vpp_rank * spec.pp + pp_rank) * spec.layers_per_chunk
    return range(start, start + spec.layers_per_chunk)


# --------------------------------------------------------------------------------------------------
# Reference weights (Megatron names of a TP=PP=EP=1 local-spec GPTModel, global layer numbers)
# --------------------------------------------------------------------------------------------------


def _layer_shapes(spec: MegatronSpec, layer: int = 0) -> dict[str, tuple[tuple[int, ...], str]]:
    """Tensors of layer ``layer`` (name after ``decoder.layers.N.``) -> (shape, kind) in a TP=1 model."""
    fam = spec.family_info
    h, d = spec.hidden_size, spec.kv_channels
    qkv_rows = (spec.num_heads + 2 * spec.num_kv_heads) * d
    s: dict[str, tuple[tuple[int, ...], str]] = {"input_layernorm.weight": ((h,), "norm")}
    if fam.mla:
        s.update(_mla_shapes(spec))
    else:
        s["self_attention.linear_qkv.weight"] = ((qkv_rows, h), "matrix")
        if fam.qkv_bias:
            s["self_attention.linear_qkv.bias"] = ((qkv_rows,), "bias")
        if fam.qk_norm:
            s["self_attention.q_layernorm.weight"] = ((d,), "norm")
            s["self_attention.k_layernorm.weight"] = ((d,), "norm")
        s["self_attention.linear_proj.weight"] = ((h, spec.num_heads * d), "matrix")
    s["pre_mlp_layernorm.weight"] = ((h,), "norm")
    if spec.is_moe_layer(layer):
        assert spec.num_experts is not None and spec.moe_ffn_hidden_size is not None
        f = spec.moe_ffn_hidden_size
        s["mlp.router.weight"] = ((spec.num_experts, h), "matrix")
        if fam.router_sigmoid:
            s["mlp.router.expert_bias"] = ((spec.num_experts,), "bias")
        for e in range(spec.num_experts):
            s[f"mlp.experts.local_experts.{e}.linear_fc1.weight"] = ((2 * f, h), "matrix")
            s[f"mlp.experts.local_experts.{e}.linear_fc2.weight"] = ((h, f), "matrix")
        if spec.shared_expert_size:
            sf = spec.shared_expert_size
            s["mlp.shared_experts.linear_fc1.weight"] = ((2 * sf, h), "matrix")
            s["mlp.shared_experts.linear_fc2.weight"] = ((h, sf), "matrix")
            if fam.shared_expert_gate:
                s["mlp.shared_experts.gate_weight"] = ((1, h), "matrix")
    else:
        s["mlp.linear_fc1.weight"] = ((2 * spec.ffn_hidden_size, h), "matrix")
        s["mlp.linear_fc2.weight"] = ((h, spec.ffn_hidden_size), "matrix")
    return s


def _mla_shapes(spec: MegatronSpec) -> dict[str, tuple[tuple[int, ...], str]]:
    """Multi-latent attention (local spec, qk_layernorm): q and kv low-rank projections and their norms."""
    h, heads, m = spec.hidden_size, spec.num_heads, MLA_DIMS
    q_head = m["qk_nope_head_dim"] + m["qk_rope_head_dim"]
    return {
        "self_attention.linear_q_down_proj.weight": ((m["q_lora_rank"], h), "matrix"),
        "self_attention.linear_q_up_proj.weight": ((heads * q_head, m["q_lora_rank"]), "matrix"),
        "self_attention.linear_kv_down_proj.weight": ((m["kv_lora_rank"] + m["qk_rope_head_dim"], h), "matrix"),
        "self_attention.linear_kv_up_proj.weight": (
            (heads * (m["qk_nope_head_dim"] + m["v_head_dim"]), m["kv_lora_rank"]), "matrix"),
        "self_attention.q_layernorm.weight": ((m["q_lora_rank"],), "norm"),
        "self_attention.kv_layernorm.weight": ((m["kv_lora_rank"],), "norm"),
        "self_attention.linear_proj.weight": ((h, heads * m["v_head_dim"]), "matrix"),
    }


def reference_shapes(spec: MegatronSpec) -> dict[str, tuple[int, ...]]:
    """Names and shapes of ``reference_state_dict`` (no ``_extra_state``), in model order."""
    v, h = spec.padded_vocab_size, spec.hidden_size
    out: dict[str, tuple[int, ...]] = {"embedding.word_embeddings.weight": (v, h)}
    for i in range(spec.num_layers):
        for name, (shape, _) in _layer_shapes(spec, i).items():
            out[f"decoder.layers.{i}.{name}"] = shape
    out["decoder.final_layernorm.weight"] = (h,)
    for i in range(spec.mtp_layers):
        out.update({f"mtp.layers.{i}.{name}": shape for name, (shape, _) in _mtp_shapes(spec).items()})
    if not spec.tie_word_embeddings:
        out["output_layer.weight"] = (v, h)
    return out


def _mtp_shapes(spec: MegatronSpec) -> dict[str, tuple[tuple[int, ...], str]]:
    """One multi-token-prediction layer (names after ``mtp.layers.N.``): the two norms, the
    projection of [embedding; hidden], a MoE transformer layer, its final norm. It shares the
    embedding and the output layer with the model (megatron-core stores them once)."""
    h = spec.hidden_size
    s = {"enorm.weight": ((h,), "norm"), "hnorm.weight": ((h,), "norm"), "eh_proj.weight": ((h, 2 * h), "matrix")}
    s.update({f"transformer_layer.{n}": v for n, v in _layer_shapes(spec, spec.num_layers - 1).items()})
    s["final_layernorm.weight"] = ((h,), "norm")
    return s


def _kind(name: str, spec: MegatronSpec) -> str:
    if name.startswith("mtp.layers."):
        return _mtp_shapes(spec)[name.split(".", 3)[3]][1]
    if name.startswith("embedding."):
        return "embedding"
    if name == "decoder.final_layernorm.weight":
        return "norm"
    if name == "output_layer.weight":
        return "matrix"
    _, _, layer, layer_name = name.split(".", 3)
    return _layer_shapes(spec, int(layer))[layer_name][1]


def reference_state_dict(spec: MegatronSpec, seed: int = 0) -> dict[str, torch.Tensor]:
    """The full fp32 weights, drawn once: each tensor from a generator seeded by (seed, name).

    Norm weights are 1 + 0.1 N(0,1) (a swapped or dropped norm changes the logits), biases
    0.1 N(0,1), matrices N(0, 1/fan_in), embeddings N(0,1). Padded vocabulary rows are random too,
    as Megatron initialises them; only the first ``vocab_size`` rows are real tokens.
    """
    out: dict[str, torch.Tensor] = {}
    for name, shape in reference_shapes(spec).items():
        g = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
        t = torch.randn(shape, generator=g, dtype=torch.float32)
        kind = _kind(name, spec)
        if kind == "norm":
            t = 1.0 + 0.1 * t
        elif kind == "bias":
            t = 0.1 * t
        elif kind == "matrix":
            t = t / math.sqrt(shape[-1])
        out[name] = t.contiguous()
    return out


def reference_input_ids(spec: MegatronSpec, seed: int = 0) -> torch.Tensor:
    """The fixed [1, 12] prompt the logits are computed on (real tokens only, < vocab_size)."""
    g = torch.Generator().manual_seed(seed + 12345)
    return torch.randint(0, spec.vocab_size, (1, _SEQ_LEN), generator=g)


# --------------------------------------------------------------------------------------------------
# Per-rank slices (what each TP/PP/VPP/EP rank's GPTModel chunk holds, local names and numbers)
# --------------------------------------------------------------------------------------------------


def _split(t: torch.Tensor, parts: int, rank: int, dim: int) -> torch.Tensor:
    return torch.chunk(t, parts, dim=dim)[rank].contiguous()


# Multi-latent attention in the local spec: every projection but linear_proj is a ColumnParallelLinear,
# the low-rank down-projections too (their outputs are gathered before the norms); TransformerEngine's
# spec duplicates the down-projections instead (TELinear, parallel_mode="duplicated"), which needs a GPU.
MLA_COLUMN_PARALLEL = ("linear_q_down_proj.weight", "linear_kv_down_proj.weight", "linear_q_up_proj.weight",
                       "linear_kv_up_proj.weight", "linear_q_proj.weight")


def _tp_slice(layer_name: str, t: torch.Tensor, tp: int, tp_rank: int) -> torch.Tensor:
    """The TP rank's part of one per-layer tensor (expert tensor parallel = tp)."""
    if tp == 1:
        return t
    if layer_name.endswith(("linear_qkv.weight", "linear_qkv.bias")):
        # Column parallel, contiguous rows: whole query groups when kv_heads % tp == 0, and when
        # tp > kv_heads megatron-core 0.16 splits the grouped rows evenly (no KV replication).
        return _split(t, tp, tp_rank, 0)
    if layer_name.endswith("linear_fc1.weight"):
        gate, up = torch.chunk(t, 2, dim=0)  # global fc1 = [all gate rows; all up rows]
        return torch.cat([_split(gate, tp, tp_rank, 0), _split(up, tp, tp_rank, 0)], dim=0)
    if layer_name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return _split(t, tp, tp_rank, 1)  # row parallel
    if layer_name.endswith(MLA_COLUMN_PARALLEL + ("eh_proj.weight",)):  # + an MTP layer's [embedding; hidden] projection
        return _split(t, tp, tp_rank, 0)
    return t  # norms, router, shared-expert gate: replicated


def rank_state_dict(
    spec: MegatronSpec,
    reference: Mapping[str, torch.Tensor],
    tp_rank: int,
    pp_rank: int,
    vpp_rank: int = 0,
    ep_rank: int = 0,
) -> dict[str, torch.Tensor]:
    """The tensors one model chunk holds, in local-spec names with local layer/expert numbers.

    Tied embeddings with PP > 1: the last stage holds ``output_layer.weight`` = the embedding.
    ``_extra_state`` entries are not included.
    """
    layers = layer_range(spec, pp_rank, vpp_rank)
    first = pp_rank == 0 and vpp_rank == 0
    last = pp_rank == spec.pp - 1 and vpp_rank == spec.vpp_size - 1
    out: dict[str, torch.Tensor] = {}
    if first:
        embedding = reference["embedding.word_embeddings.weight"]
        out["embedding.word_embeddings.weight"] = _split(embedding, spec.tp, tp_rank, 0)
    experts_per_rank = (spec.num_experts or 0) // spec.ep
    expert_re = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.*)$")
    for local, global_layer in enumerate(layers):
        for layer_name in _layer_shapes(spec, global_layer):
            t = reference[f"decoder.layers.{global_layer}.{layer_name}"]
            name = layer_name
            m = expert_re.match(layer_name)
            if m:
                expert = int(m.group(1))
                if expert // experts_per_rank != ep_rank:
                    continue
                name = f"mlp.experts.local_experts.{expert % experts_per_rank}.{m.group(2)}"
            out[f"decoder.layers.{local}.{name}"] = _tp_slice(layer_name, t, spec.tp, tp_rank)
    if last:
        out["decoder.final_layernorm.weight"] = reference["decoder.final_layernorm.weight"]
        if spec.mtp_layers and not first:  # the MTP block embeds tokens too: the last stage holds a copy
            out["embedding.word_embeddings.weight"] = _split(reference["embedding.word_embeddings.weight"], spec.tp,
                                                             tp_rank, 0)
        for i in range(spec.mtp_layers):
            for name in _mtp_shapes(spec):
                m = expert_re.match(name.removeprefix("transformer_layer."))
                local = name
                if m:
                    expert = int(m.group(1))
                    if expert // experts_per_rank != ep_rank:
                        continue
                    local = f"transformer_layer.mlp.experts.local_experts.{expert % experts_per_rank}.{m.group(2)}"
                out[f"mtp.layers.{i}.{local}"] = _tp_slice(name, reference[f"mtp.layers.{i}.{name}"], spec.tp, tp_rank)
        head = "embedding.word_embeddings.weight" if spec.tie_word_embeddings else "output_layer.weight"
        if not (spec.tie_word_embeddings and first):  # PP=1 tied: the head reuses the embedding
            out["output_layer.weight"] = _split(reference[head], spec.tp, tp_rank, 0)
    return out


# --------------------------------------------------------------------------------------------------
# Global (dist_ckpt / torch_dist) view of the reference
# --------------------------------------------------------------------------------------------------


def _dist_layer_key(layer_name: str, spec: MegatronSpec | None = None) -> str:
    """Local-spec layer tensor name -> torch_dist key suffix (megatron's sharded keys map; the
    local MLA spec has none, so its norms keep their module names)."""
    if spec is not None and spec.family_info.mla:
        return layer_name
    if layer_name == "input_layernorm.weight":
        return "self_attention.linear_qkv.layer_norm_weight"
    if layer_name == "pre_mlp_layernorm.weight":
        # The local spec maps this for MoE layers too; a TE-spec MoE layer keeps pre_mlp_layernorm.
        return "mlp.linear_fc1.layer_norm_weight"
    return layer_name


def reference_dist_global(spec: MegatronSpec, reference: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The reference as global torch_dist tensors: layers stacked on dim 0, TE-style names.

    ``decoder.layers.<name>`` is [num_layers, ...]; experts are
    ``decoder.layers.mlp.experts.experts.linear_fc{1,2}.weight`` [num_layers, num_experts, ...];
    ``linear_fc1`` rows are [all gate; all up]; vocab stays padded; no ``output_layer`` when tied.
    Mixed dense / MoE layers (``spec.mixed_layers``): no stacking over layers, every layer has its
    own keys ``decoder.layers.<L>.<name>`` and experts ``decoder.layers.<L>.mlp.experts.experts.
    linear_fc{1,2}.weight`` [num_experts, ...] (megatron-core's non-homogeneous layers).
    """
    out: dict[str, torch.Tensor] = {"embedding.word_embeddings.weight": reference["embedding.word_embeddings.weight"]}
    expert_re = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.*)$")
    if spec.mixed_layers:
        for i in range(spec.num_layers):
            experts: dict[str, list[torch.Tensor]] = {}
            for name in _layer_shapes(spec, i):
                m = expert_re.match(name)
                if m:
                    experts.setdefault(m.group(2), []).append(reference[f"decoder.layers.{i}.{name}"])
                else:
                    out[f"decoder.layers.{i}.{_dist_layer_key(name, spec)}"] = reference[f"decoder.layers.{i}.{name}"]
            for part, tensors in experts.items():
                out[f"decoder.layers.{i}.mlp.experts.experts.{part}"] = torch.stack(tensors)
        return _dist_tail(spec, reference, out)
    layer_names = list(_layer_shapes(spec))
    expert_parts: dict[str, list[str]] = {}
    for name in layer_names:
        m = expert_re.match(name)
        if m:
            expert_parts.setdefault(m.group(2), []).append(name)
            continue
        stacked = torch.stack([reference[f"decoder.layers.{i}.{name}"] for i in range(spec.num_layers)])
        out[f"decoder.layers.{_dist_layer_key(name, spec)}"] = stacked
    for part, names in expert_parts.items():
        per_layer = [torch.stack([reference[f"decoder.layers.{i}.{n}"] for n in names]) for i in range(spec.num_layers)]
        out[f"decoder.layers.mlp.experts.experts.{part}"] = torch.stack(per_layer)
    return _dist_tail(spec, reference, out)


def _dist_tail(spec: MegatronSpec, reference: Mapping[str, torch.Tensor], out: dict[str, torch.Tensor]
               ) -> dict[str, torch.Tensor]:
    out["decoder.final_layernorm.weight"] = reference["decoder.final_layernorm.weight"]
    expert_re = re.compile(r"^transformer_layer\.mlp\.experts\.local_experts\.(\d+)\.(.*)$")
    for i in range(spec.mtp_layers):  # MTP layers: per-layer keys (no stacking), experts stacked on dim 0
        experts: dict[str, list[torch.Tensor]] = {}
        for name in _mtp_shapes(spec):
            m = expert_re.match(name)
            if m:
                experts.setdefault(m.group(2), []).append(reference[f"mtp.layers.{i}.{name}"])
            else:
                key = name if not name.startswith("transformer_layer.") else \
                    "transformer_layer." + _dist_layer_key(name.removeprefix("transformer_layer."), spec)
                out[f"mtp.layers.{i}.{key}"] = reference[f"mtp.layers.{i}.{name}"]
        for part, tensors in experts.items():
            out[f"mtp.layers.{i}.transformer_layer.mlp.experts.experts.{part}"] = torch.stack(tensors)
    if not spec.tie_word_embeddings:
        out["output_layer.weight"] = reference["output_layer.weight"]
    return out


# --------------------------------------------------------------------------------------------------
# TransformerEngine-style legacy names (what a TE-spec GPU run's state_dict() holds)
# --------------------------------------------------------------------------------------------------


def te_legacy_name(spec: MegatronSpec, local_name: str, dense_layer: bool = False) -> str:
    """Local-spec state_dict key -> the key a TransformerEngine-spec GPTModel has for it.

    input_layernorm -> self_attention.linear_qkv.layer_norm_weight; dense pre_mlp_layernorm ->
    mlp.linear_fc1.layer_norm_weight (MoE layers keep pre_mlp_layernorm; ``dense_layer``: the key's
    layer has a dense MLP, as the first layers of a mixed model); SequentialMLP experts
    ``mlp.experts.local_experts.{i}.linear_fcN.weight`` -> TEGroupedMLP ``mlp.experts.linear_fcN.weight{i}``.
    """
    name = re.sub(r"\.input_layernorm\.weight$", ".self_attention.linear_qkv.layer_norm_weight", local_name)
    if not spec.is_moe or dense_layer:
        name = re.sub(r"\.pre_mlp_layernorm\.weight$", ".mlp.linear_fc1.layer_norm_weight", name)
    name = re.sub(r"\.mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight$", r".mlp.experts.\2.weight\1", name)
    return name


def _to_te_names(spec: MegatronSpec, state: Mapping[str, object]) -> dict[str, object]:
    """Rename a chunk state dict as TE would, with TE's non-fp8 extra state (empty uint8 tensor)."""
    out: dict[str, object] = {}
    for key, value in state.items():
        if key.endswith("._extra_state"):
            module = key[: -len("._extra_state")]
            expert = re.match(r"^(.*\.mlp\.experts)\.local_experts\.(\d+)\.(linear_fc[12])$", module)
            if expert:
                if expert.group(2) != "0":
                    continue  # one TEGroupedLinear per fcN, not one per expert
                module = f"{expert.group(1)}.{expert.group(3)}"
            if module.endswith("output_layer"):
                out[key] = value  # a plain ColumnParallelLinear in the TE spec too
                continue
            out[f"{module}._extra_state"] = torch.empty(0, dtype=torch.uint8)
            if module.endswith("self_attention.linear_proj"):
                core_attention = module.replace("linear_proj", "core_attention")
                out[f"{core_attention}._extra_state"] = torch.empty(0, dtype=torch.uint8)
            continue
        out.update(te_legacy_names(spec, {key: value}, dense_mlp=_dense_mlp_layers(state)))
    return out


def _dense_mlp_layers(state: Mapping[str, object]) -> set[str]:
    """``decoder.layers.N.`` prefixes of the layers in ``state`` with a dense MLP."""
    suffix = "mlp.linear_fc1.weight"
    return {k[: -len(suffix)] for k in state if k.endswith(suffix) and ".experts." not in k and "shared" not in k}


def te_legacy_names(spec: MegatronSpec, state: Mapping[str, object], dense_mlp: set[str] | None = None
                    ) -> dict[str, object]:
    """A chunk's tensors (no extra states) renamed by `te_legacy_name`, each layer's MLP kind
    (dense or MoE) taken from ``state`` itself (or ``dense_mlp``, its layer prefixes)."""
    dense = _dense_mlp_layers(state) if dense_mlp is None else dense_mlp
    out = {}
    for key, value in state.items():
        layer = re.match(r"^(.*decoder\.layers\.\d+\.)", key)
        out[te_legacy_name(spec, key, bool(layer) and layer.group(1) in dense)] = value
    return out


def _from_te_names(spec: MegatronSpec, state: Mapping[str, object]) -> dict[str, object]:
    """Inverse of ``_to_te_names`` for loading: TE keys -> local-spec keys (extra states dropped)."""
    out: dict[str, object] = {}
    for key, value in state.items():
        if key.endswith("._extra_state"):
            continue
        name = re.sub(r"\.self_attention\.linear_qkv\.layer_norm_weight$", ".input_layernorm.weight", key)
        name = re.sub(r"\.mlp\.linear_fc1\.layer_norm_weight$", ".pre_mlp_layernorm.weight", name)
        name = re.sub(
            r"\.mlp\.experts\.(linear_fc[12])\.weight(\d+)$", r".mlp.experts.local_experts.\2.\1.weight", name
        )
        out[name] = value
    return out


# --------------------------------------------------------------------------------------------------
# Hugging Face oracle: independent, straightforward conversion of the reference
# --------------------------------------------------------------------------------------------------


def hf_config_dict(spec: MegatronSpec) -> dict[str, object]:
    """Keyword arguments of the transformers config for this spec (model_type included)."""
    fam = spec.family_info
    cfg: dict[str, object] = {
        "model_type": fam.model_type,
        "architectures": [fam.architecture],
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "max_position_embeddings": MAX_POSITIONS,
        "rms_norm_eps": fam.norm_eps,
        "rope_parameters": {"rope_type": "default", "rope_theta": fam.rope_theta},
        "tie_word_embeddings": spec.tie_word_embeddings,
        "attention_dropout": 0.0,
        "hidden_act": "silu",
        "intermediate_size": spec.ffn_hidden_size,
        "dtype": "float32",
    }
    if fam.head_dim_override:
        cfg["head_dim"] = spec.kv_channels
    if fam.model_type in ("qwen2", "qwen2_moe", "qwen3", "qwen3_moe"):
        cfg["use_sliding_window"] = False
    if fam.model_type == "mistral":
        cfg["sliding_window"] = None
    if fam.model_type == "mixtral":
        cfg.update(
            intermediate_size=spec.moe_ffn_hidden_size,
            num_local_experts=spec.num_experts,
            num_experts_per_tok=spec.moe_topk,
            router_jitter_noise=0.0,
            sliding_window=None,
        )
    if fam.model_type in ("qwen2_moe", "qwen3_moe"):
        cfg.update(
            moe_intermediate_size=spec.moe_ffn_hidden_size,
            num_experts=spec.num_experts,
            num_experts_per_tok=spec.moe_topk,
            norm_topk_prob=not fam.router_pre_softmax,
            decoder_sparse_step=1,
            mlp_only_layers=spec.dense_layers,
        )
    if fam.model_type == "qwen2_moe":
        cfg["shared_expert_intermediate_size"] = spec.shared_expert_size
    if fam.router_sigmoid:  # DeepSeek-V3, GLM-4.5
        assert spec.moe_ffn_hidden_size and spec.shared_expert_size
        cfg.update(
            moe_intermediate_size=spec.moe_ffn_hidden_size,
            n_routed_experts=spec.num_experts,
            n_shared_experts=spec.shared_expert_size // spec.moe_ffn_hidden_size,
            num_experts_per_tok=spec.moe_topk,
            routed_scaling_factor=ROUTED_SCALING_FACTOR,
            n_group=1,
            topk_group=1,
            norm_topk_prob=True,
            first_k_dense_replace=len(spec.dense_layers),
        )
    if fam.model_type == "glm4_moe":
        cfg.update(attention_bias=fam.qkv_bias, use_qk_norm=fam.qk_norm)
        cfg["rope_parameters"] = dict(cfg["rope_parameters"], partial_rotary_factor=fam.rotary_percent)
    if fam.model_type == "deepseek_v3":
        cfg.update(
            **MLA_DIMS,
            num_key_value_heads=spec.num_heads,
            # megatron-core's MLA de-interleaves the rope dims before rotating them, as transformers does
            # with rope_interleave (the Hub default); with rope_interleave=False the logits differ by ~1.7
            rope_interleave=True,
            attention_bias=False,
        )
    return cfg


def reference_to_hf(spec: MegatronSpec, reference: Mapping[str, torch.Tensor], mtp: bool = False
                    ) -> dict[str, torch.Tensor]:
    """Convert the reference (TP=1 Megatron layout) to Hugging Face tensors, hub naming.

    linear_qkv rows are per query group [q heads of the group; k; v]; linear_fc1 rows are
    [gate; up]; the vocabulary is cut back to ``vocab_size``; tied models get no ``lm_head``.
    Mixtral uses ``block_sparse_moe.experts.E.w1/w2/w3``; Qwen MoE ``mlp.experts.E.gate/up/down_proj``.
    ``mtp``: add DeepSeek's multi-token-prediction layers as its Hub checkpoints hold them, layer
    ``num_layers + i`` with ``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm`` and copies of the
    embedding (``embed_tokens``) and output layer (``shared_head.head``).
    """
    fam = spec.family_info
    d, groups = spec.kv_channels, spec.num_kv_heads
    q_per_group = spec.num_heads // groups
    out: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": reference["embedding.word_embeddings.weight"][: spec.vocab_size],
        "model.norm.weight": reference["decoder.final_layernorm.weight"],
    }
    if not spec.tie_word_embeddings:
        out["lm_head.weight"] = reference["output_layer.weight"][: spec.vocab_size]

    def split_qkv(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        rest = t.shape[1:]
        grouped = t.reshape(groups, q_per_group + 2, d, *rest)
        q = grouped[:, :q_per_group].reshape(spec.num_heads * d, *rest)
        k = grouped[:, q_per_group].reshape(groups * d, *rest)
        v = grouped[:, q_per_group + 1].reshape(groups * d, *rest)
        return q, k, v

    def convert_layer(src: str, dst: str, moe_layer: bool) -> None:
        out[dst + "input_layernorm.weight"] = reference[src + "input_layernorm.weight"]
        out[dst + "post_attention_layernorm.weight"] = reference[src + "pre_mlp_layernorm.weight"]
        for part in (("weight", "bias") if fam.qkv_bias else ("weight",)) if not fam.mla else ():
            q, k, v = split_qkv(reference[src + f"self_attention.linear_qkv.{part}"])
            out[dst + f"self_attn.q_proj.{part}"] = q
            out[dst + f"self_attn.k_proj.{part}"] = k
            out[dst + f"self_attn.v_proj.{part}"] = v
        out[dst + "self_attn.o_proj.weight"] = reference[src + "self_attention.linear_proj.weight"]
        if fam.mla:  # same rows and columns on both sides: MLA is a renaming
            for megatron_name, hf_name in (("linear_q_down_proj", "q_a_proj"), ("q_layernorm", "q_a_layernorm"),
                                           ("linear_q_up_proj", "q_b_proj"),
                                           ("linear_kv_down_proj", "kv_a_proj_with_mqa"),
                                           ("kv_layernorm", "kv_a_layernorm"), ("linear_kv_up_proj", "kv_b_proj")):
                out[dst + f"self_attn.{hf_name}.weight"] = reference[src + f"self_attention.{megatron_name}.weight"]
        if fam.qk_norm:
            out[dst + "self_attn.q_norm.weight"] = reference[src + "self_attention.q_layernorm.weight"]
            out[dst + "self_attn.k_norm.weight"] = reference[src + "self_attention.k_layernorm.weight"]
        if not moe_layer:
            gate, up = torch.chunk(reference[src + "mlp.linear_fc1.weight"], 2, dim=0)
            out[dst + "mlp.gate_proj.weight"] = gate
            out[dst + "mlp.up_proj.weight"] = up
            out[dst + "mlp.down_proj.weight"] = reference[src + "mlp.linear_fc2.weight"]
            return
        moe = dst + ("block_sparse_moe." if fam.model_type == "mixtral" else "mlp.")
        out[moe + "gate.weight"] = reference[src + "mlp.router.weight"]
        if fam.router_sigmoid:
            out[moe + "gate.e_score_correction_bias"] = reference[src + "mlp.router.expert_bias"]
        for e in range(spec.num_experts or 0):
            gate, up = torch.chunk(reference[src + f"mlp.experts.local_experts.{e}.linear_fc1.weight"], 2, dim=0)
            down = reference[src + f"mlp.experts.local_experts.{e}.linear_fc2.weight"]
            if fam.model_type == "mixtral":
                out[moe + f"experts.{e}.w1.weight"] = gate
                out[moe + f"experts.{e}.w3.weight"] = up
                out[moe + f"experts.{e}.w2.weight"] = down
            else:
                out[moe + f"experts.{e}.gate_proj.weight"] = gate
                out[moe + f"experts.{e}.up_proj.weight"] = up
                out[moe + f"experts.{e}.down_proj.weight"] = down
        if spec.shared_expert_size:
            shared = moe + ("shared_expert." if fam.shared_expert_gate else "shared_experts.")
            gate, up = torch.chunk(reference[src + "mlp.shared_experts.linear_fc1.weight"], 2, dim=0)
            out[shared + "gate_proj.weight"] = gate
            out[shared + "up_proj.weight"] = up
            out[shared + "down_proj.weight"] = reference[src + "mlp.shared_experts.linear_fc2.weight"]
            if fam.shared_expert_gate:
                out[moe + "shared_expert_gate.weight"] = reference[src + "mlp.shared_experts.gate_weight"]
    for i in range(spec.num_layers):
        convert_layer(f"decoder.layers.{i}.", f"model.layers.{i}.", spec.is_moe_layer(i))
    for i in range(spec.mtp_layers if mtp else 0):
        src, dst = f"mtp.layers.{i}.", f"model.layers.{spec.num_layers + i}."
        convert_layer(src + "transformer_layer.", dst, True)
        for name in ("enorm.weight", "hnorm.weight", "eh_proj.weight"):
            out[dst + name] = reference[src + name]
        out[dst + "shared_head.norm.weight"] = reference[src + "final_layernorm.weight"]
        out[dst + "embed_tokens.weight"] = out["model.embed_tokens.weight"]
        out[dst + "shared_head.head.weight"] = out.get("lm_head.weight", out["model.embed_tokens.weight"])
    return {k: v.contiguous() for k, v in out.items()}


def _write_hf_config(directory: Path, spec: MegatronSpec) -> None:
    from transformers import AutoConfig

    kwargs = hf_config_dict(spec)
    model_type = kwargs.pop("model_type")
    config = AutoConfig.for_model(model_type, **kwargs)
    directory.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(directory)


def _write_hf_metadata(directory: Path, spec: MegatronSpec) -> None:
    """config.json + tokenizer (synthetic_runs.tokenizer), no weights: what verl puts beside its shards."""
    from synthetic_runs.tokenizer import save_tokenizer

    _write_hf_config(directory, spec)
    save_tokenizer(directory, spec.vocab_size)


def write_reference(reference_dir: Path, spec: MegatronSpec, seed: int = 0) -> dict[str, torch.Tensor]:
    """Write ``megatron_state.safetensors``, ``hf/`` and ``input_ids.pt``; return the reference.

    ``logits.pt`` is added by the megatron-core forward pass in ``write_megatron_step``.
    """
    reference = reference_state_dict(spec, seed)
    reference_dir.mkdir(parents=True, exist_ok=True)
    save_file(reference, str(reference_dir / REFERENCE_STATE_FILE), metadata={"format": "pt"})
    hf_dir = reference_dir / REFERENCE_HF_DIR
    _write_hf_metadata(hf_dir, spec)
    save_file(reference_to_hf(spec, reference), str(hf_dir / "model.safetensors"), metadata={"format": "pt"})
    torch.save(reference_input_ids(spec, seed), reference_dir / REFERENCE_INPUT_IDS_FILE)
    return reference


# --------------------------------------------------------------------------------------------------
# On-disk layout (shared by the writer and the loader)
# --------------------------------------------------------------------------------------------------


def rank_dir_name(spec: MegatronSpec, tp_rank: int, pp_rank: int, ep_rank: int) -> str:
    """``mp_rank_TT[_PPP][_EEE]``: the PP part only when pp > 1, the EP part only when ep > 1."""
    name = f"mp_rank_{tp_rank:02d}"
    if spec.pp > 1:
        name += f"_{pp_rank:03d}"
    if spec.ep > 1:
        name += f"_{ep_rank:03d}"
    return name


def _step_number(step_dir: Path) -> int | None:
    m = re.fullmatch(r"(?:global_step_|iter_)(\d+)", step_dir.name)
    return int(m.group(1)) if m else None


def model_dir(step_dir: Path, spec: MegatronSpec) -> Path:
    """Where the model shards of ``spec.fmt`` live under ``step_dir``."""
    return {
        "legacy": step_dir / "actor" / "model",
        "megatron_lm": step_dir,
        "megatron_lm_dist": step_dir,
        "dist_v1": step_dir / "actor" / "dist_ckpt",
        "dist_v2": step_dir / "actor" / "model" / "dist_ckpt",
        "bridge_v2": step_dir / "actor" / "model" / "huggingface",
    }[spec.fmt]


def _hf_metadata_dir(step_dir: Path, spec: MegatronSpec) -> Path | None:
    return {
        "legacy": step_dir / "actor" / "hf_config_and_tokenizer",
        "megatron_lm": None,
        "megatron_lm_dist": None,
        "dist_v1": step_dir / "actor" / "huggingface",
        "dist_v2": step_dir / "actor" / "model" / "huggingface",
        "bridge_v2": step_dir / "actor" / "model" / "huggingface",
    }[spec.fmt]


def _ckpt_contents(spec: MegatronSpec, step: int) -> dict[str, object]:
    """verl 0.9 ``ckpt_contents.json`` (schema 2) for save_contents [model, extra]: dist_v2 is
    use_dist_checkpointing=True without a bridge, bridge_v2 is mbridge (HF weights) without it."""
    bridge = spec.fmt == "bridge_v2"
    contents: dict[str, object] = {
        "model": (
            {"path": "model/huggingface", "format": "huggingface", "backend": "mbridge"}
            if bridge
            else {"path": "model/dist_ckpt", "format": "megatron_dist_checkpoint", "backend": "dist_checkpointing"}
        ),
        "rng_state": {"path": "extra/dist_ckpt", "format": "megatron_dist_checkpoint", "key": "rng_state"},
        "transformer_config": {"path": "transformer_config.json", "format": "json"},
    }
    directories = {"extra/dist_ckpt": "Megatron dist_checkpointing shards for extra state (rng_state)."}
    if bridge:
        contents["hf_config"] = {
            "path": "model/huggingface",
            "format": "huggingface",
            "note": "config.json, tokenizer, and optional generation_config.json",
        }
        contents["tokenizer"] = {"path": "model/huggingface", "format": "huggingface"}
        directories["model/huggingface"] = (
            "HuggingFace-format artifacts written via mbridge: model weights, "
            "config.json, tokenizer files, and optional generation_config.json."
        )
    else:
        directories["model/dist_ckpt"] = (
            "Megatron dist_checkpointing shards for model weights (or PEFT adapter shards when mbridge is enabled)."
        )
    return {
        "schema_version": 2,
        "framework": "megatron",
        "role": "actor",
        "arch": spec.family_info.architecture,
        "global_step": step,
        "world_size": spec.world_size,
        "backend": {"has_bridge": bridge, "use_dist_checkpointing": not bridge, "peft": False},
        "save_contents": ["model", "extra"],
        "contents": contents,
        "directories": directories,
        "saved_any_dist_ckpt": True,
    }


def _write_hf_weights_sharded(directory: Path, tensors: Mapping[str, torch.Tensor], shards: int = 2) -> None:
    """``model-0000i-of-0000n.safetensors`` + ``model.safetensors.index.json``, as a bridge export writes."""
    names = list(tensors)
    per_shard = math.ceil(len(names) / shards)
    weight_map: dict[str, str] = {}
    total = 0
    for i in range(shards):
        part = {n: tensors[n].contiguous() for n in names[i * per_shard : (i + 1) * per_shard]}
        filename = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file(part, str(directory / filename), metadata={"format": "pt"})
        weight_map.update({n: filename for n in part})
        total += sum(t.numel() * t.element_size() for t in part.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def _write_json_atomically(path: Path, payload: object) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(payload, f, indent=2, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _update_tracker(step_dir: Path) -> None:
    step = _step_number(step_dir)
    if step is None:
        return
    tracker = step_dir.parent / TRACKER_FILE
    previous = int(tracker.read_text().strip()) if tracker.exists() else -1
    if step > previous:
        tracker.write_text(str(step))


# --------------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StepJob:
    """One checkpoint for ``write_megatron_steps``: where, what, which weights, reference or not."""

    step_dir: Path
    spec: MegatronSpec
    seed: int = 0
    reference_dir: Path | None = None


def write_megatron_step(step_dir: Path, spec: MegatronSpec, seed: int = 0, reference_dir: Path | None = None) -> None:
    """Write one real megatron-core checkpoint (see the module docstring for the layouts).

    reference_dir, when given, receives ``megatron_state.safetensors`` (full global Megatron state,
    TP=PP=1 names, padded vocab), ``hf/`` (transformers-loadable oracle), ``input_ids.pt`` and
    ``logits.pt`` (megatron-core forward logits [1, 12, vocab_size], fp32, CPU).
    """
    write_megatron_steps([StepJob(Path(step_dir), spec, seed, Path(reference_dir) if reference_dir else None)])


def write_megatron_steps(jobs: Sequence[StepJob], world_size: int | None = None) -> float:
    """Write many checkpoints with ONE spawned gloo world; return the wall time in seconds.

    The world has ``world_size`` processes (default: the largest ``spec.world_size``); a job
    needing fewer runs with the rest as data-parallel replicas (real DP > 1: only DP rank 0 writes
    legacy files, dist_checkpointing spreads the replicated shards over DP ranks). Every job's
    world size must divide it. Raises on any worker error (the other workers are stopped).
    """
    started = time.perf_counter()
    jobs = [StepJob(Path(j.step_dir), j.spec, j.seed, Path(j.reference_dir) if j.reference_dir else None) for j in jobs]
    if not jobs:
        return 0.0
    world = world_size or max(j.spec.world_size for j in jobs)
    for j in jobs:
        if world % j.spec.world_size:
            raise ValueError(f"world size {world} is not a multiple of {j.spec.world_size} needed by {j.spec}")
    for j in jobs:
        if j.reference_dir is not None:
            write_reference(j.reference_dir, j.spec, j.seed)
        meta = _hf_metadata_dir(j.step_dir, j.spec)
        if meta is not None:
            _write_hf_metadata(meta, j.spec)
    _spawn(world, [("write", j) for j in jobs])
    for j in jobs:
        if j.spec.fmt == "bridge_v2":
            weights = reference_to_hf(j.spec, reference_state_dict(j.spec, j.seed))
            _write_hf_weights_sharded(model_dir(j.step_dir, j.spec), weights)
        if j.spec.fmt in ("dist_v2", "bridge_v2"):
            step = _step_number(j.step_dir) or 0
            _write_json_atomically(j.step_dir / "actor" / "ckpt_contents.json", _ckpt_contents(j.spec, step))
        _update_tracker(j.step_dir)
    return time.perf_counter() - started


@dataclass(frozen=True)
class LogitsJob:
    """One checkpoint to load back into megatron-core for ``megatron_forward_logits_many``."""

    checkpoint_dir: Path
    spec: MegatronSpec
    input_ids: torch.Tensor


def megatron_forward_logits(checkpoint_dir: Path, spec: MegatronSpec, input_ids: torch.Tensor) -> torch.Tensor:
    """Load a checkpoint back into megatron-core GPTModels (gloo, CPU) and return forward logits.

    ``checkpoint_dir`` is either the step dir as written by ``write_megatron_step`` or the folder
    holding the shards themselves (``mp_rank_*`` folders, or a torch_dist folder with ``.metadata``):
    the reverse-split test points it at ``stepmerge split`` output. ``spec`` gives the model and
    parallel layout; ``spec.fmt`` selects the reader (``legacy`` and ``megatron_lm`` accept local
    and TransformerEngine key names; ``dist_v1``/``dist_v2`` read any torch_dist folder). Loads are
    strict: a missing, unexpected or misshapen tensor fails. Returns fp32 [B, S, vocab_size] logits.
    """
    return megatron_forward_logits_many([LogitsJob(Path(checkpoint_dir), spec, input_ids)])[0]


def megatron_forward_logits_many(jobs: Sequence[LogitsJob], world_size: int | None = None) -> list[torch.Tensor]:
    """``megatron_forward_logits`` for several checkpoints in ONE gloo world (see write_megatron_steps)."""
    world = world_size or max(j.spec.world_size for j in jobs)
    for j in jobs:
        if world % j.spec.world_size:
            raise ValueError(f"world size {world} is not a multiple of {j.spec.world_size} needed by {j.spec}")
    with tempfile.TemporaryDirectory(prefix="megatron_logits_") as tmp:
        outs = [Path(tmp) / f"logits_{i}.pt" for i in range(len(jobs))]
        tasks: list[tuple[str, object]] = [
            ("load", (Path(j.checkpoint_dir), j.spec, j.input_ids.clone(), out)) for j, out in zip(jobs, outs)
        ]
        _spawn(world, tasks)
        return [torch.load(out, weights_only=True) for out in outs]


def megatron_fixture_matrix() -> dict[str, MegatronSpec]:
    """The checkpoints the Megatron merge tests run on (name -> spec); world sizes 1, 2 and 4.

    Covers TP x PP in {1x1, 2x1, 1x2, 2x2}, VPP 2 (legacy, megatron_lm and dist), GQA with
    TP > KV heads (tp=2, kv=1), tied (PP=1 and PP>1) and untied, MoE with EP 2 (also with PP 2,
    with expert TP 2, and with shared experts), mixed dense / MoE layers (torch_dist and TE-named
    legacy), DeepSeek-V3 (MLA; also at TP 2), GLM-4.5, TE-style legacy names, every family, every format; tied
    Llama and Qwen3 as Llama-3.2-1B and Qwen3-0.6B-4B ship (dist_ckpt, TP 2 and PP 2).
    """
    s = MegatronSpec
    return {
        "llama_tp1_pp1_legacy": s(family="llama", fmt="legacy"),
        "qwen2_tp2_pp1_tied_legacy": s(family="qwen2", tp=2, tie_word_embeddings=True, fmt="legacy"),
        "mistral_tp1_pp2_legacy": s(family="mistral", pp=2, fmt="legacy"),
        "llama_tp2_pp2_vpp2_legacy": s(family="llama", tp=2, pp=2, vpp=2, num_layers=8, fmt="legacy"),
        "qwen3_tp2_kv1_legacy": s(family="qwen3", tp=2, num_kv_heads=1, head_dim=32, fmt="legacy"),
        "mixtral_ep2_legacy": s(family="mixtral", ep=2, fmt="legacy"),
        "qwen2_moe_pp2_ep2_te_legacy": s(family="qwen2_moe", pp=2, ep=2, legacy_names="te", fmt="legacy"),
        "llama_tp2_pp2_te_legacy": s(family="llama", tp=2, pp=2, legacy_names="te", fmt="legacy"),
        "qwen2_pp2_vpp2_tied_megatron_lm": s(
            family="qwen2", pp=2, vpp=2, num_layers=8, tie_word_embeddings=True, fmt="megatron_lm"
        ),
        "llama_tp1_pp1_dist_v1": s(family="llama", fmt="dist_v1"),
        "mistral_tp2_pp2_tied_dist_v2": s(family="mistral", tp=2, pp=2, tie_word_embeddings=True, fmt="dist_v2"),
        "qwen3_tp2_kv1_pp2_vpp2_dist_v1": s(
            family="qwen3", tp=2, pp=2, vpp=2, num_layers=8, num_kv_heads=1, head_dim=32, fmt="dist_v1"
        ),
        "qwen2_moe_ep2_dist_v2": s(family="qwen2_moe", ep=2, fmt="dist_v2"),
        "mixtral_tp2_megatron_lm_dist": s(family="mixtral", tp=2, fmt="megatron_lm_dist"),
        "qwen2_tp2_pp2_bridge_v2": s(family="qwen2", tp=2, pp=2, fmt="bridge_v2"),
        "qwen3_moe_pp2_ep2_dist_v1": s(family="qwen3_moe", pp=2, ep=2, fmt="dist_v1"),
        "qwen3_moe_tp2_ep2_legacy": s(family="qwen3_moe", tp=2, ep=2, fmt="legacy"),
        # mixed dense / MoE layers (first dense layer; mlp_only_layers): per-layer torch_dist keys
        "qwen3_moe_dense0_pp2_ep2_dist_v1": s(family="qwen3_moe", pp=2, ep=2, moe_layer_freq=(0, 1, 1, 1),
                                              fmt="dist_v1"),
        "qwen2_moe_mixed_tp2_ep2_te_legacy": s(family="qwen2_moe", tp=2, ep=2, moe_layer_freq=(0, 1, 0, 1),
                                               legacy_names="te", fmt="legacy"),
        # DeepSeek-V3: MLA, sigmoid router + expert bias, shared experts, first dense layers
        # (+ one multi-token-prediction layer, on the last stage)
        "deepseek_v3_pp2_ep2_dist_v2": s(family="deepseek_v3", num_kv_heads=4, pp=2, ep=2,
                                         moe_layer_freq=(0, 1, 1, 1), mtp_layers=1, fmt="dist_v2"),
        "deepseek_v3_ep2_legacy": s(family="deepseek_v3", num_kv_heads=4, ep=2, moe_layer_freq=(0, 0, 1, 1),
                                    mtp_layers=1, fmt="legacy"),
        # DeepSeek-V3 at TP 2 (local spec: the MLA down-projections are column-parallel, cut in row pieces;
        # the MTP layer's too, and its eh_proj)
        "deepseek_v3_tp2_ep2_legacy": s(family="deepseek_v3", num_kv_heads=4, tp=2, ep=2, moe_layer_freq=(0, 1, 1, 1),
                                        mtp_layers=1, fmt="legacy"),
        "deepseek_v3_tp2_pp2_dist_v1": s(family="deepseek_v3", num_kv_heads=4, tp=2, pp=2, moe_layer_freq=(0, 1, 1, 1),
                                         fmt="dist_v1"),
        # GLM-4.5: q/k/v bias + q/k norms, half-rotary RoPE, sigmoid router + bias, shared experts, layer 0 dense
        "glm4_moe_tp2_ep2_dist_v1": s(family="glm4_moe", tp=2, ep=2, moe_layer_freq=(0, 1, 1, 1), fmt="dist_v1"),
        # tied as the small releases RL teams start from ship: Llama-3.2-1B, Qwen3-0.6B / 1.7B / 4B (the head on the
        # last stage of PP 2, the embedding on the first)
        "llama_tp2_tied_dist_v2": s(family="llama", tp=2, tie_word_embeddings=True, fmt="dist_v2"),
        "qwen3_pp2_tied_dist_v2": s(family="qwen3", pp=2, head_dim=32, tie_word_embeddings=True, fmt="dist_v2"),
    }


def write_fixture_matrix(root: Path, names: Iterable[str] | None = None, seed: int = 0) -> dict[str, StepJob]:
    """Write the matrix (or the named part of it) under ``root`` in one gloo world of 4 processes.

    Layout: ``root/<name>/run/global_step_1`` (``run/iter_0000001`` for megatron_lm*) and
    ``root/<name>/reference``. Returns name -> job.
    """
    matrix = megatron_fixture_matrix()
    chosen = list(names) if names is not None else list(matrix)
    jobs: dict[str, StepJob] = {}
    for name in chosen:
        spec = matrix[name]
        step = "iter_0000001" if spec.fmt.startswith("megatron_lm") else "global_step_1"
        jobs[name] = StepJob(root / name / "run" / step, spec, seed, root / name / "reference")
    write_megatron_steps(list(jobs.values()), world_size=max([4] + [j.spec.world_size for j in jobs.values()]))
    return jobs


# --------------------------------------------------------------------------------------------------
# The gloo world: _spawn runs in the caller, everything after it in the worker processes
# --------------------------------------------------------------------------------------------------


_WORKER_PRELOAD = [
    "synthetic_runs.megatron_shims",
    "synthetic_runs.megatron",
    "megatron.core.models.gpt.gpt_layer_specs",
    "megatron.core.models.gpt",
    "megatron.core.dist_checkpointing",
]


def _spawn(world: int, tasks: list[tuple[str, object]]) -> None:
    """Run ``tasks`` in a fresh gloo world of ``world`` processes; re-raise a worker's error.

    Workers fork from a forkserver that imported torch and megatron-core once (an import costs
    ~3.6 s of CPU per process); the forkserver itself never runs torch ops, so the forks are clean.
    """
    import multiprocessing

    import torch.multiprocessing as mp

    multiprocessing.set_forkserver_preload(_WORKER_PRELOAD)
    with tempfile.TemporaryDirectory(prefix="megatron_gloo_") as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        mp.start_processes(_worker, args=(world, init_file, tasks), nprocs=world, join=True, start_method="forkserver")


def _worker(rank: int, world: int, init_file: str, tasks: list[tuple[str, object]]) -> None:
    import warnings
    from datetime import timedelta

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    from synthetic_runs.megatron_shims import install_cpu_shims

    install_cpu_shims()
    torch.distributed.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=timedelta(minutes=5)
    )
    try:
        for kind, payload in tasks:
            if kind == "write":
                assert isinstance(payload, StepJob)
                _write_job(payload)
            else:
                checkpoint_dir, spec, input_ids, out = payload  # type: ignore[misc]
                _load_job(checkpoint_dir, spec, input_ids, out)
    finally:
        from megatron.core import parallel_state as ps

        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        torch.distributed.destroy_process_group()


def _init_parallel(spec: MegatronSpec) -> None:
    from megatron.core import parallel_state as ps

    from synthetic_runs.megatron_shims import use_cpu_rng_tracker

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=spec.tp,
        pipeline_model_parallel_size=spec.pp,
        virtual_pipeline_model_parallel_size=spec.vpp,
        expert_model_parallel_size=spec.ep,
    )
    use_cpu_rng_tracker()


def _transformer_config(spec: MegatronSpec):  # -> megatron.core.transformer.TransformerConfig
    from megatron.core.transformer import TransformerConfig

    fam = spec.family_info
    kw: dict[str, object] = dict(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        ffn_hidden_size=spec.ffn_hidden_size,
        num_attention_heads=spec.num_heads,
        num_query_groups=spec.num_kv_heads,
        kv_channels=spec.kv_channels,
        normalization="RMSNorm",
        layernorm_epsilon=fam.norm_eps,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=fam.qkv_bias,
        qk_layernorm=fam.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
        tensor_model_parallel_size=spec.tp,
        pipeline_model_parallel_size=spec.pp,
        virtual_pipeline_model_parallel_size=spec.vpp,
        expert_model_parallel_size=spec.ep,
        sequence_parallel=False,
        persist_layer_norm=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
    )
    if fam.mla:
        from megatron.core.transformer.transformer_config import MLATransformerConfig

        kw.update(q_lora_rank=MLA_DIMS["q_lora_rank"], kv_lora_rank=MLA_DIMS["kv_lora_rank"],
                  qk_head_dim=MLA_DIMS["qk_nope_head_dim"], qk_pos_emb_head_dim=MLA_DIMS["qk_rope_head_dim"],
                  v_head_dim=MLA_DIMS["v_head_dim"], rope_type="rope", rotary_base=fam.rope_theta,
                  kv_channels=MLA_DIMS["v_head_dim"],
                  qk_layernorm=True, multi_latent_attention=True)
    if fam.router_sigmoid:
        kw.update(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                  moe_router_topk_scaling_factor=ROUTED_SCALING_FACTOR)
    if fam.moe:
        kw.update(
            num_moe_experts=spec.num_experts,
            moe_ffn_hidden_size=spec.moe_ffn_hidden_size,
            moe_router_topk=spec.moe_topk,
            moe_router_pre_softmax=fam.router_pre_softmax,
            moe_shared_expert_intermediate_size=spec.shared_expert_size,
            moe_shared_expert_gate=fam.shared_expert_gate,
            moe_token_dispatcher_type="allgather",  # alltoall creates a torch.cuda.Stream
            moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0,
            moe_grouped_gemm=False,
        )
        if spec.moe_layer_freq is not None:
            kw["moe_layer_freq"] = list(spec.moe_layer_freq)
    if spec.mtp_layers:
        kw["mtp_num_layers"] = spec.mtp_layers
    if fam.mla:
        return MLATransformerConfig(**kw)
    return TransformerConfig(**kw)


def _build_chunks(spec: MegatronSpec) -> list[torch.nn.Module]:
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    config = _transformer_config(spec)
    layer_spec = get_gpt_layer_local_spec(
        num_experts=spec.num_experts,
        moe_grouped_gemm=False,
        qk_layernorm=spec.family_info.qk_norm or spec.family_info.mla,
        multi_latent_attention=spec.family_info.mla,
        normalization="RMSNorm",
    )
    chunks = []
    for v in range(spec.vpp_size):
        extra = {"vp_stage": v} if spec.vpp else {}
        if spec.moe_layer_freq is not None:  # per-layer specs: dense or MoE (megatron's own block spec)
            from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

            layer_spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm",
                                                    vp_stage=v if spec.vpp else None)
        if spec.family_info.mla:
            from synthetic_runs.megatron_shims import mla_core_attention

            for layer in getattr(layer_spec, "layer_specs", None) or [layer_spec]:
                layer.submodules.self_attention.submodules.core_attention = mla_core_attention()
        if spec.mtp_layers:
            from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

            extra["mtp_block_spec"] = get_gpt_mtp_block_spec(config, layer_spec, use_transformer_engine=False,
                                                             vp_stage=v if spec.vpp else None)
        if spec.vpp:
            pre = ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=v)
            post = ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=v)
        else:
            pre, post = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
        chunk = GPTModel(
            config=config,
            transformer_layer_spec=layer_spec,
            vocab_size=spec.padded_vocab_size,
            max_sequence_length=MAX_POSITIONS,
            pre_process=pre,
            post_process=post,
            share_embeddings_and_output_weights=spec.tie_word_embeddings,
            position_embedding_type="rope",
            rotary_base=int(spec.family_info.rope_theta),
            rotary_percent=spec.family_info.rotary_percent,
            parallel_output=False,
            **extra,
        )
        chunk.eval()
        chunks.append(chunk)
    return chunks


def _ranks() -> tuple[int, int, int]:
    from megatron.core import parallel_state as ps

    return (
        ps.get_tensor_model_parallel_rank(),
        ps.get_pipeline_model_parallel_rank(),
        ps.get_expert_model_parallel_rank(),
    )


def _load_chunk(chunk: torch.nn.Module, state: Mapping[str, object]) -> None:
    """Strict load; ``_extra_state`` entries the model expects are filled with None when absent."""
    full = dict(state)
    for key in chunk.state_dict():
        if key.endswith("._extra_state") and key not in full:
            full[key] = None
    chunk.load_state_dict(full, strict=True)


def _sharded_metadata(spec: MegatronSpec) -> dict[str, object] | None:
    """The metadata verl 0.9 / Megatron-LM (mcore >= 0.14) pass to sharded_state_dict; None for v1."""
    if spec.fmt not in ("dist_v2", "bridge_v2", "megatron_lm_dist"):
        return None
    from megatron.core import parallel_state as ps

    return {
        "distrib_optim_sharding_type": "dp_reshardable",
        "singleton_local_shards": False,
        "chained_optim_avoid_prefix": True,
        "dp_cp_group": ps.get_data_parallel_group(with_context_parallel=True),
    }


def _content_metadata(spec: MegatronSpec) -> dict[str, object] | None:
    """What ``dist_checkpointing.save(content_metadata=...)`` records in common.pt (no groups)."""
    metadata = _sharded_metadata(spec)
    return None if metadata is None else {k: v for k, v in metadata.items() if k != "dp_cp_group"}


def _check_against_megatron_sharding(
    spec: MegatronSpec, chunks: Sequence[torch.nn.Module], expected: Mapping[str, torch.Tensor]
) -> None:
    """Every tensor this rank holds == the global reference slice megatron-core says it holds."""
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    checked = 0
    for v, chunk in enumerate(chunks):
        if spec.vpp:
            ps.set_virtual_pipeline_model_parallel_rank(v)
        sharded = chunk.sharded_state_dict(metadata=_sharded_metadata(spec))
        apply_factories(sharded)
        for sh in nested_values(sharded):
            if not isinstance(sh, ShardedTensor):
                continue
            if sh.key not in expected:
                raise AssertionError(f"megatron-core holds {sh.key!r}, absent from the reference global view")
            glob = expected[sh.key]
            if tuple(glob.shape) != tuple(sh.global_shape):
                raise AssertionError(
                    f"{sh.key}: reference global shape {tuple(glob.shape)} != megatron {sh.global_shape}"
                )
            want = glob[sh.global_slice()]
            if not torch.equal(sh.data, want):
                raise AssertionError(f"{sh.key} at {sh.global_offset}: rank tensor differs from the reference slice")
            checked += 1
    if checked == 0:
        raise AssertionError("no sharded tensor was checked")


def _rng_state() -> dict[str, object]:
    import random

    import numpy as np
    from megatron.core import tensor_parallel

    return {
        "random_rng_state": random.getstate(),
        "np_rng_state": np.random.get_state(),
        "torch_rng_state": torch.get_rng_state(),
        "rng_tracker_states": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }


def _rng_sharded_object():  # -> ShardedObject, as verl / Megatron-LM save it
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    return ShardedObject(
        "rng_state",
        [_rng_state()],
        (ps.get_pipeline_model_parallel_world_size(), ps.get_tensor_model_parallel_world_size()),
        (ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank()),
        replica_id=ps.get_data_parallel_rank(with_context_parallel=True),
    )


def _is_file_writer(spec: MegatronSpec) -> bool:
    """The rank that writes this (tp, pp, ep) file: DP rank 0, or expert-DP rank 0 with EP."""
    from megatron.core import parallel_state as ps

    if spec.ep > 1:
        return ps.get_expert_data_parallel_rank() == 0
    return ps.get_data_parallel_rank() == 0


def _chunk_states(spec: MegatronSpec, chunks: Sequence[torch.nn.Module]) -> list[dict[str, object]]:
    states = [dict(c.state_dict()) for c in chunks]
    if spec.legacy_names == "te":
        states = [_to_te_names(spec, s) for s in states]
    return states


def _megatron_lm_args(spec: MegatronSpec, iteration: int, ckpt_format: str = "torch") -> argparse.Namespace:
    fam = spec.family_info
    return argparse.Namespace(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        ffn_hidden_size=spec.ffn_hidden_size,
        num_attention_heads=spec.num_heads,
        group_query_attention=spec.num_kv_heads != spec.num_heads,
        num_query_groups=spec.num_kv_heads,
        kv_channels=spec.kv_channels,
        max_position_embeddings=MAX_POSITIONS,
        position_embedding_type="rope",
        rotary_base=int(fam.rope_theta),
        normalization="RMSNorm",
        norm_epsilon=fam.norm_eps,
        swiglu=True,
        add_bias_linear=False,
        add_qkv_bias=fam.qkv_bias,
        qk_layernorm=fam.qk_norm,
        untie_embeddings_and_output_weights=not spec.tie_word_embeddings,
        padded_vocab_size=spec.padded_vocab_size,
        make_vocab_size_divisible_by=spec.make_vocab_size_divisible_by,
        tensor_model_parallel_size=spec.tp,
        pipeline_model_parallel_size=spec.pp,
        virtual_pipeline_model_parallel_size=spec.vpp,
        expert_model_parallel_size=spec.ep,
        num_experts=spec.num_experts,
        moe_ffn_hidden_size=spec.moe_ffn_hidden_size,
        moe_router_topk=spec.moe_topk,
        moe_shared_expert_intermediate_size=spec.shared_expert_size,
        moe_layer_freq=list(spec.moe_layer_freq) if spec.moe_layer_freq is not None else 1,
        params_dtype=torch.float32,
        ckpt_format=ckpt_format,
        iteration=iteration,
    )


def _transformer_config_json(config: object) -> dict[str, object]:
    """verl's transformer_config.json: the config's dataclass fields, JSON-safe, callables dropped."""

    def safe(value: object) -> object:
        if value is None or isinstance(value, (str, int, float, bool)):
            return value
        if isinstance(value, torch.dtype) or hasattr(value, "name") and hasattr(value, "value"):
            return str(value)
        if isinstance(value, (list, tuple)):
            return [safe(v) for v in value]
        if isinstance(value, dict):
            return {str(k): safe(v) for k, v in value.items()}
        return _SKIP

    out: dict[str, object] = {}
    for field in dataclasses.fields(config):  # type: ignore[arg-type]
        value = getattr(config, field.name, None)
        if callable(value) and not isinstance(value, type):
            continue
        converted = safe(value)
        if converted is not _SKIP:
            out[field.name] = converted
    return out


_SKIP = object()


def _save_dist(directory: Path, state: dict[str, object], content_metadata: dict[str, object] | None) -> None:
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper

    if torch.distributed.get_rank() == 0:
        directory.mkdir(parents=True, exist_ok=True)
    torch.distributed.barrier()
    strategy = FullyParallelSaveStrategyWrapper(
        get_default_save_sharded_strategy("torch_dist"), ps.get_data_parallel_group(with_context_parallel=True)
    )
    kwargs = {"content_metadata": content_metadata} if content_metadata is not None else {}
    dist_checkpointing.save(state, str(directory), sharded_strategy=strategy, validate_access_integrity=True, **kwargs)
    torch.distributed.barrier()


def _model_sharded_state(spec: MegatronSpec, chunks: Sequence[torch.nn.Module]) -> dict[str, object]:
    from megatron.core import parallel_state as ps

    state: dict[str, object] = {}
    for v, chunk in enumerate(chunks):
        if spec.vpp:
            ps.set_virtual_pipeline_model_parallel_rank(v)
        key = f"model{v}" if spec.vpp else "model"
        state[key] = chunk.sharded_state_dict(metadata=_sharded_metadata(spec))
    return state


def _save_checkpoint(job: StepJob, chunks: Sequence[torch.nn.Module]) -> None:
    spec, step_dir = job.spec, job.step_dir
    target = model_dir(step_dir, spec)
    tp_rank, pp_rank, ep_rank = _ranks()
    if spec.fmt in RANK_FILE_FORMATS:
        if _is_file_writer(spec):
            rank_dir = target / rank_dir_name(spec, tp_rank, pp_rank, ep_rank)
            rank_dir.mkdir(parents=True, exist_ok=True)
            states = _chunk_states(spec, chunks)
            if spec.fmt == "legacy":
                torch.save(states, rank_dir / "model.pt")
            else:
                iteration = _step_number(step_dir) or 0
                payload: dict[str, object] = {
                    "args": _megatron_lm_args(spec, iteration),
                    "checkpoint_version": 3.0,
                    "iteration": iteration,
                }
                if spec.vpp:
                    payload.update({f"model{v}": s for v, s in enumerate(states)})
                else:
                    payload["model"] = states[0]
                payload["rng_state"] = [_rng_state()]
                payload["num_floating_point_operations_so_far"] = 0
                torch.save(payload, rank_dir / "model_optim_rng.pt")
        torch.distributed.barrier()
        return
    content_metadata = _content_metadata(spec)
    if spec.fmt == "megatron_lm_dist":
        # Megatron-LM's torch_dist save: the non-sharded entries (args, versions) land in common.pt.
        iteration = _step_number(step_dir) or 0
        state = _model_sharded_state(spec, chunks)
        state.update(
            args=_megatron_lm_args(spec, iteration, ckpt_format="torch_dist"),
            checkpoint_version=3.0,
            iteration=iteration,
            rng_state=_rng_sharded_object(),
            num_floating_point_operations_so_far=0,
        )
        _save_dist(target, state, content_metadata)
        return
    extra_dir = step_dir / "actor" / "extra" / "dist_ckpt"
    if spec.fmt == "dist_v1":  # one dist_ckpt folder: model (+ rng; verl also puts optimizer here)
        _save_dist(target, {**_model_sharded_state(spec, chunks), "rng_state": _rng_sharded_object()}, None)
    elif spec.fmt == "dist_v2":
        _save_dist(target, _model_sharded_state(spec, chunks), content_metadata)
        _save_dist(extra_dir, {"rng_state": _rng_sharded_object()}, content_metadata)
    else:  # bridge_v2: the weights are the parent's safetensors export; dist_checkpointing has rng only
        _save_dist(extra_dir, {"rng_state": _rng_sharded_object()}, content_metadata)
    if torch.distributed.get_rank() == 0:
        config_json = _transformer_config_json(chunks[0].config)
        (step_dir / "actor" / "transformer_config.json").write_text(json.dumps(config_json, indent=2))
    torch.distributed.barrier()


@torch.no_grad()
def _forward_logits(
    spec: MegatronSpec, chunks: Sequence[torch.nn.Module], input_ids: torch.Tensor
) -> torch.Tensor | None:
    """Run the pipeline chunk by chunk (interleaved order), broadcasting activations over PP.

    Returns the full-vocab logits [B, S, vocab_size] on last-stage ranks, None elsewhere.
    """
    from megatron.core import parallel_state as ps

    pp_group = ps.get_pipeline_model_parallel_group()
    pp_ranks = torch.distributed.get_process_group_ranks(pp_group)
    my_pp = ps.get_pipeline_model_parallel_rank()
    batch, seq = input_ids.shape
    position_ids = torch.arange(seq).unsqueeze(0).expand(batch, seq)
    mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1)[None, None]
    hidden: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    order = [(v, p) for v in range(spec.vpp_size) for p in range(spec.pp)]
    for step, (v, p) in enumerate(order):
        is_last = step == len(order) - 1
        if spec.vpp:
            ps.set_virtual_pipeline_model_parallel_rank(v)
        if my_pp == p:
            chunk = chunks[v]
            if hidden is not None:
                chunk.set_input_tensor(hidden)
            out = _main_model_forward(chunk, input_ids, position_ids, mask)
        else:
            shape = (batch, seq, spec.padded_vocab_size) if is_last else (seq, batch, spec.hidden_size)
            out = torch.empty(shape, dtype=torch.float32)
        if spec.pp > 1:
            out = out.contiguous()
            torch.distributed.broadcast(out, src=pp_ranks[p], group=pp_group)
        if is_last:
            logits = out
        else:
            hidden = out
    assert logits is not None
    return logits[..., : spec.vocab_size].float().clone() if my_pp == spec.pp - 1 else None


def _main_model_forward(chunk: torch.nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor,
                        mask: torch.Tensor) -> torch.Tensor:
    """The model's logits. With MTP layers megatron-core 0.16.1's forward needs labels (``labels.clone()``)
    and then returns the loss, not logits: the MTP block is switched off for this call (it does not
    feed the main model's logits; transformers does not run it either)."""
    mtp = getattr(chunk, "mtp_process", False)
    if not mtp:
        return chunk(input_ids=input_ids, position_ids=position_ids, attention_mask=mask)
    layers = chunk.config.mtp_num_layers
    chunk.mtp_process, chunk.config.mtp_num_layers = False, None
    try:
        return chunk(input_ids=input_ids, position_ids=position_ids, attention_mask=mask)
    finally:
        chunk.mtp_process, chunk.config.mtp_num_layers = True, layers


def _write_job(job: StepJob) -> None:
    spec = job.spec
    _init_parallel(spec)
    torch.manual_seed(job.seed)
    reference = reference_state_dict(spec, job.seed)
    chunks = _build_chunks(spec)
    tp_rank, pp_rank, ep_rank = _ranks()
    for v, chunk in enumerate(chunks):
        _load_chunk(chunk, rank_state_dict(spec, reference, tp_rank, pp_rank, v, ep_rank))
    _check_against_megatron_sharding(spec, chunks, reference_dist_global(spec, reference))
    _save_checkpoint(job, chunks)
    logits = _forward_logits(spec, chunks, reference_input_ids(spec, job.seed))
    if job.reference_dir is not None and torch.distributed.get_rank() == _last_stage_first_rank():
        assert logits is not None
        torch.save(logits, job.reference_dir / REFERENCE_LOGITS_FILE)
    torch.distributed.barrier()


def _last_stage_first_rank() -> int:
    """Global rank of (tp 0, last pp stage, dp 0, ep 0): ranks are ordered tp-cp-ep-dp-pp."""
    from megatron.core import parallel_state as ps

    world = torch.distributed.get_world_size()
    per_stage = world // ps.get_pipeline_model_parallel_world_size()
    return world - per_stage


# ---- loading shards back (reverse-split check) ---------------------------------------------------


def _shard_folder(checkpoint_dir: Path, spec: MegatronSpec) -> Path:
    """The folder holding the shards: ``checkpoint_dir`` itself, or the layout's place under it."""
    if spec.fmt in RANK_FILE_FORMATS:
        candidates = [checkpoint_dir, model_dir(checkpoint_dir, spec), checkpoint_dir / "model"]
        found = [c for c in candidates if c.is_dir() and any(c.glob("mp_rank_*"))]
    else:
        candidates = [
            checkpoint_dir,
            model_dir(checkpoint_dir, spec),
            checkpoint_dir / "actor" / "dist_ckpt",
            checkpoint_dir / "actor" / "model" / "dist_ckpt",
            checkpoint_dir / "model" / "dist_ckpt",
            checkpoint_dir / "dist_ckpt",
        ]
        found = [c for c in candidates if (c / ".metadata").is_file()]
    if not found:
        raise FileNotFoundError(f"no {spec.fmt} shards in {checkpoint_dir} (looked in {[str(c) for c in candidates]})")
    return found[0]


def _megatron_lm_safe_globals() -> list[object]:
    """What Megatron-LM files pickle besides tensors: ``args`` (argparse.Namespace) and the numpy
    RNG state (numpy ``_reconstruct``, ``ndarray``, ``dtype``, ``UInt32DType``). verl's files need none."""
    import numpy as np

    try:
        from numpy._core.multiarray import _reconstruct
    except ImportError:  # numpy < 2
        from numpy.core.multiarray import _reconstruct  # type: ignore[no-redef]
    return [argparse.Namespace, _reconstruct, np.ndarray, np.dtype, type(np.dtype("uint32"))]


def _load_rank_file(path: Path) -> object:
    """``torch.load(weights_only=True)`` with the Megatron-LM allowlist."""
    with torch.serialization.safe_globals(_megatron_lm_safe_globals()):
        return torch.load(path, map_location="cpu", weights_only=True)


def _load_job(checkpoint_dir: Path, spec: MegatronSpec, input_ids: torch.Tensor, out: Path) -> None:
    if spec.fmt == "bridge_v2":
        raise ValueError("a bridge export is a Hugging Face folder: load it with transformers, not megatron-core")
    _init_parallel(spec)
    chunks = _build_chunks(spec)
    tp_rank, pp_rank, ep_rank = _ranks()
    if spec.fmt in RANK_FILE_FORMATS:
        base = _shard_folder(checkpoint_dir, spec)
        rank_dir = base / rank_dir_name(spec, tp_rank, pp_rank, ep_rank)
        if spec.fmt == "legacy":
            states = _load_rank_file(rank_dir / "model.pt")
        else:
            payload = _load_rank_file(rank_dir / "model_optim_rng.pt")
            assert isinstance(payload, dict)
            states = [payload[f"model{v}"] for v in range(spec.vpp_size)] if spec.vpp else [payload["model"]]
        if not isinstance(states, list) or len(states) != len(chunks):
            raise ValueError(f"{rank_dir}: expected {len(chunks)} chunk state dicts")
        for chunk, state in zip(chunks, states):
            _load_chunk(chunk, _from_te_names(spec, state))
    else:
        from megatron.core import dist_checkpointing

        base = _shard_folder(checkpoint_dir, spec)
        with torch.serialization.safe_globals(_megatron_lm_safe_globals()):  # Megatron-LM's common.pt
            loaded = dist_checkpointing.load(_model_sharded_state(spec, chunks), str(base))
        for v, chunk in enumerate(chunks):
            _load_chunk(chunk, loaded[f"model{v}" if spec.vpp else "model"])
    logits = _forward_logits(spec, chunks, input_ids)
    if logits is not None and torch.distributed.get_rank() == _last_stage_first_rank():
        torch.save(logits, out)
    torch.distributed.barrier()
