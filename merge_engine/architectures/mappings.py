"""The vocabulary of the family tables: model dimensions, one class per kind of mapping, the table.

A family table (`FamilyTable`) is a dict of 1:1 names plus a short tuple of special mappings.
Names are patterns with ``*`` for a number: the layer index, then (experts) the expert index;
each ``*`` on the Megatron side is the same number on the Hugging Face side, in order.

Megatron names are the *canonical* Megatron names every layout reduces a checkpoint to: the
local-spec names of a TP = PP = EP = 1 model, global layer and expert numbers, padded vocabulary
(``decoder.layers.3.self_attention.linear_qkv.weight``,
``decoder.layers.3.mlp.experts.local_experts.5.linear_fc1.weight``).

Each mapping has both directions as methods (`to_hf`, `to_megatron`) and the shapes of both sides,
so a plan can be made from shapes alone. The tensor math lives in `transforms`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping as MappingType
from dataclasses import dataclass, field, replace
from functools import cache
from typing import TYPE_CHECKING, Any

from merge_engine.architectures import transforms

if TYPE_CHECKING:  # the mappings' tensor maths lives in `transforms`, which imports torch when it runs
    import torch

Shape = tuple[int, ...]
VISION_TOWER = "visual."  # a vision-language model's tower: the same names in Megatron-Bridge and Hugging Face


@dataclass(frozen=True)
class ModelDims:
    """What the mappings need to know about the model, read from config.json."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    num_layers: int
    tied: bool
    num_experts: int = 0
    moe_layers: frozenset[int] = frozenset()
    padded_vocab_size: int | None = None  # HF -> Megatron only: rows of the padded embedding
    vision_layers: int = 0  # blocks of a vision tower (``vision_config.depth``), scope ``vision``

    @property
    def mixed_layers(self) -> bool:
        """Some layers MoE, some dense: megatron-core keys each layer on its own in torch_dist."""
        return bool(self.moe_layers) and len(self.moe_layers) < self.num_layers

    def layers_in_scope(self, scope: str) -> range | list[int]:
        """Layer numbers a mapping of ``scope`` (see `scope_of`) applies to."""
        if scope in ("moe", "experts"):
            return sorted(self.moe_layers)
        if scope == "dense":
            return [i for i in range(self.num_layers) if i not in self.moe_layers]
        if scope == "vision":
            return range(self.vision_layers)
        return range(self.num_layers)


@cache
def compile_pattern(pattern: str) -> re.Pattern[str]:
    """``a.*.b`` -> a regex whose groups are the numbers standing for each ``*``."""
    return re.compile("^" + r"([0-9]+)".join(re.escape(part) for part in pattern.split("*")) + "$")


def fill(pattern: str, numbers: tuple[int, ...]) -> str:
    """``fill("a.*.b.*", (3, 5))`` -> ``"a.3.b.5"``."""
    parts = pattern.split("*")
    if len(parts) - 1 != len(numbers):
        raise ValueError(f"pattern {pattern!r} takes {len(parts) - 1} numbers, got {numbers}")
    out = parts[0]
    for number, part in zip(numbers, parts[1:]):
        out += str(number) + part
    return out


def scope_of(megatron_pattern: str) -> str:
    """Which layers a mapping covers, from Megatron's module names (the same in every family):
    ``global`` (no layer), ``experts`` (per MoE layer and expert), ``moe`` (router, shared experts),
    ``dense`` (the dense MLP), ``layer`` (every layer), ``vision`` (every block of a vision tower,
    ``visual.blocks.*``)."""
    if "*" not in megatron_pattern:
        return "global"
    if megatron_pattern.startswith(VISION_TOWER):
        return "vision"
    if ".mlp.experts." in megatron_pattern:
        return "experts"
    if ".mlp.router." in megatron_pattern or ".mlp.shared_experts." in megatron_pattern:
        return "moe"
    if ".mlp." in megatron_pattern:
        return "dense"
    return "layer"


@dataclass(frozen=True)
class ParamMapping:
    """One Megatron tensor <-> one or more Hugging Face tensors.

    ``requires``: a config key that must be truthy for the model to have these tensors
    (``attention_bias``, ``shared_expert_intermediate_size``); None: always present.
    """

    megatron: str
    requires: str | None = field(default=None, kw_only=True)

    @property
    def hf(self) -> tuple[str, ...]:
        raise NotImplementedError

    def hf_shapes(self, shape: Shape, dims: ModelDims) -> tuple[Shape, ...]:
        raise NotImplementedError

    def megatron_shape(self, hf_shapes: tuple[Shape, ...], dims: ModelDims) -> Shape:
        raise NotImplementedError

    def to_hf(self, tensor: torch.Tensor, dims: ModelDims) -> tuple[torch.Tensor, ...]:
        raise NotImplementedError

    def to_megatron(self, tensors: tuple[torch.Tensor, ...], dims: ModelDims) -> torch.Tensor:
        raise NotImplementedError

    def applies(self, config: MappingType[str, Any]) -> bool:
        return self.requires is None or bool(config.get(self.requires))


@dataclass(frozen=True)
class DirectMapping(ParamMapping):
    """Same values, new name."""

    hf_name: str = ""

    @property
    def hf(self) -> tuple[str, ...]:
        return (self.hf_name,)

    def hf_shapes(self, shape: Shape, dims: ModelDims) -> tuple[Shape, ...]:
        return (shape,)

    def megatron_shape(self, hf_shapes: tuple[Shape, ...], dims: ModelDims) -> Shape:
        return hf_shapes[0]

    def to_hf(self, tensor: torch.Tensor, dims: ModelDims) -> tuple[torch.Tensor, ...]:
        return (tensor,)

    def to_megatron(self, tensors: tuple[torch.Tensor, ...], dims: ModelDims) -> torch.Tensor:
        return tensors[0]


@dataclass(frozen=True)
class VocabMapping(ParamMapping):
    """Embedding or output layer: Megatron's padded vocabulary rows <-> ``config.vocab_size`` rows.

    ``head=True`` marks the output layer: absent from Hugging Face when the embeddings are tied.
    """

    hf_name: str = ""
    head: bool = False

    @property
    def hf(self) -> tuple[str, ...]:
        return (self.hf_name,)

    def hf_shapes(self, shape: Shape, dims: ModelDims) -> tuple[Shape, ...]:
        if shape[0] < dims.vocab_size:
            raise ValueError(f"{shape[0]} vocabulary rows, fewer than config vocab_size {dims.vocab_size}")
        return ((dims.vocab_size, *shape[1:]),)

    def megatron_shape(self, hf_shapes: tuple[Shape, ...], dims: ModelDims) -> Shape:
        return (dims.padded_vocab_size or hf_shapes[0][0], *hf_shapes[0][1:])

    def to_hf(self, tensor: torch.Tensor, dims: ModelDims) -> tuple[torch.Tensor, ...]:
        return (transforms.trim_vocab(tensor, dims.vocab_size),)

    def to_megatron(self, tensors: tuple[torch.Tensor, ...], dims: ModelDims) -> torch.Tensor:
        return transforms.pad_vocab(tensors[0], dims.padded_vocab_size or tensors[0].shape[0])


@dataclass(frozen=True)
class QKVMapping(ParamMapping):
    """Fused ``linear_qkv`` (grouped per query group) <-> separate q, k, v projections (GQA aware)."""

    q: str = ""
    k: str = ""
    v: str = ""

    @property
    def hf(self) -> tuple[str, ...]:
        return (self.q, self.k, self.v)

    def hf_shapes(self, shape: Shape, dims: ModelDims) -> tuple[Shape, ...]:
        d, rest = dims.head_dim, shape[1:]
        expected = (dims.num_heads + 2 * dims.num_kv_heads) * d
        if shape[0] != expected:
            raise ValueError(f"linear_qkv has {shape[0]} rows; config ({dims.num_heads} heads, "
                             f"{dims.num_kv_heads} KV heads, head_dim {d}) implies {expected}")
        return ((dims.num_heads * d, *rest), (dims.num_kv_heads * d, *rest), (dims.num_kv_heads * d, *rest))

    def megatron_shape(self, hf_shapes: tuple[Shape, ...], dims: ModelDims) -> Shape:
        return (sum(s[0] for s in hf_shapes), *hf_shapes[0][1:])

    def to_hf(self, tensor: torch.Tensor, dims: ModelDims) -> tuple[torch.Tensor, ...]:
        return transforms.split_qkv(tensor, dims.num_heads, dims.num_kv_heads, dims.head_dim)

    def to_megatron(self, tensors: tuple[torch.Tensor, ...], dims: ModelDims) -> torch.Tensor:
        q, k, v = tensors
        return transforms.merge_qkv(q, k, v, dims.num_heads, dims.num_kv_heads, dims.head_dim)


@dataclass(frozen=True)
class GatedMLPMapping(ParamMapping):
    """Gated ``linear_fc1`` = [gate; up] <-> separate gate and up projections."""

    gate: str = ""
    up: str = ""

    @property
    def hf(self) -> tuple[str, ...]:
        return (self.gate, self.up)

    def hf_shapes(self, shape: Shape, dims: ModelDims) -> tuple[Shape, ...]:
        if shape[0] % 2:
            raise ValueError(f"gated linear_fc1 has an odd row count {shape[0]}")
        half = (shape[0] // 2, *shape[1:])
        return (half, half)

    def megatron_shape(self, hf_shapes: tuple[Shape, ...], dims: ModelDims) -> Shape:
        return (2 * hf_shapes[0][0], *hf_shapes[0][1:])

    def to_hf(self, tensor: torch.Tensor, dims: ModelDims) -> tuple[torch.Tensor, ...]:
        return transforms.split_gate_up(tensor)

    def to_megatron(self, tensors: tuple[torch.Tensor, ...], dims: ModelDims) -> torch.Tensor:
        return transforms.merge_gate_up(*tensors)


@dataclass(frozen=True)
class FamilyTable:
    """One model family: which configs it serves and how its tensors are named on both sides.

    ``direct`` is the dict of 1:1 names (Megatron pattern -> Hugging Face pattern); ``special``
    the mappings that fuse, split or trim. ``experts_keys`` names the config keys that may hold the
    number of routed experts (MoE families; transformers renamed some between versions).
    ``moe_layer_rule`` (one of `MOE_LAYER_RULES`) says which layers are MoE from the config:
    ``"all"``; ``"qwen"`` (``decoder_sparse_step`` and ``mlp_only_layers``); ``"first_k_dense"``
    (DeepSeek, GLM-4.5: layers from ``first_k_dense_replace`` on, every ``moe_layer_freq``-th).
    ``dense_layers``: layers with a dense MLP whatever the rule says (a custom mapping's override).
    ``megatron_prefix``: where the checkpoint keeps the language model (Megatron-Bridge's
    vision-language models: ``language_model.``); readers strip it, the split's writer adds it.
    """

    name: str
    model_types: tuple[str, ...]
    architectures: tuple[str, ...]
    direct: MappingType[str, str]
    special: tuple[ParamMapping, ...] = ()
    experts_keys: tuple[str, ...] = ()
    moe_layer_rule: str = "all"
    dense_layers: tuple[int, ...] = ()
    megatron_prefix: str = ""

    def mappings(self) -> tuple[ParamMapping, ...]:
        return tuple(DirectMapping(m, hf_name=h) for m, h in self.direct.items()) + tuple(self.special)

    def extended(self, **changes: Any) -> FamilyTable:
        return replace(self, **changes)

    def moe_layers(self, config: MappingType[str, Any]) -> frozenset[int]:
        if not self.experts_keys:
            return frozenset()
        layers = int(config["num_hidden_layers"])
        rule = MOE_LAYER_RULES[self.moe_layer_rule]
        return frozenset(i for i in range(layers) if i not in self.dense_layers and rule(config, i))


def _qwen_moe_layer(config: MappingType[str, Any], layer: int) -> bool:
    step = int(config.get("decoder_sparse_step") or 1)
    return layer not in set(config.get("mlp_only_layers") or ()) and (layer + 1) % step == 0


def _first_k_dense_moe_layer(config: MappingType[str, Any], layer: int) -> bool:
    freq = config.get("moe_layer_freq")
    step = int(freq) if isinstance(freq, int) and freq > 0 else 1
    return layer >= int(config.get("first_k_dense_replace") or 0) and layer % step == 0


# which layers of a MoE model have experts, from its config.json: rule name -> (config, layer) -> bool
MOE_LAYER_RULES = {
    "all": lambda config, layer: True,
    "qwen": _qwen_moe_layer,
    "first_k_dense": _first_k_dense_moe_layer,
}
