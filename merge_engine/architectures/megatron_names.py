"""Canonical Megatron names: what every Megatron layout reduces its tensors to.

Canonical = the ``state_dict()`` names of a megatron-core GPTModel built with the *local* layer
spec at TP = PP = EP = 1: global layer numbers, global expert numbers, full (padded) tensors:

    embedding.word_embeddings.weight
    decoder.layers.{L}.input_layernorm.weight           (TE: self_attention.linear_qkv.layer_norm_weight)
    decoder.layers.{L}.self_attention.linear_qkv.weight
    decoder.layers.{L}.pre_mlp_layernorm.weight         (TE: mlp.linear_fc1.layer_norm_weight)
    decoder.layers.{L}.mlp.experts.local_experts.{E}.linear_fc1.weight   (TE grouped: mlp.experts.linear_fc1.weight{E})
    decoder.final_layernorm.weight
    output_layer.weight

A vision-language model saved by Megatron-Bridge keeps its language model under ``language_model.``
(`LANGUAGE_MODEL_PREFIX`): `without_language_model_prefix` gives the canonical name, and
`with_prefix` puts a table's prefix back on a language-model name for writing.

`canonical_layer_name` maps a layer-relative name from either spec (and the torch_dist keys, which
use TE names) to the local-spec name; `order_key` sorts canonical names in model order.
"""

from __future__ import annotations

import re

LAYER_NAME = re.compile(r"^decoder\.layers\.([0-9]+)\.(.+)$")
# a multi-token-prediction layer's decoder layer (DeepSeek-V3): canonical names keep Megatron's prefix
MTP_TRANSFORMER_LAYER = re.compile(r"^(mtp\.layers\.[0-9]+\.transformer_layer)\.(.+)$")
EXPERT_NAME = re.compile(r"^mlp\.experts\.local_experts\.([0-9]+)\.(.+)$")
TE_GROUPED_EXPERT = re.compile(r"^mlp\.experts\.(linear_fc[12])\.(weight|bias)([0-9]+)$")
EXTRA_STATE = "._extra_state"
LANGUAGE_MODEL_PREFIX = "language_model."
# canonical names that belong to the language model (a vision tower's names are not prefixed)
LANGUAGE_MODEL_ROOTS = ("embedding.", "decoder.", "output_layer.", "mtp.")

# TransformerEngine fuses the layer norms into the next linear layer; the local spec keeps modules.
_TE_RENAMES = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_bias": "input_layernorm.bias",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
    "mlp.linear_fc1.layer_norm_bias": "pre_mlp_layernorm.bias",
    # multi-latent attention: the low-rank norms fused into the up-projections
    "self_attention.linear_q_up_proj.layer_norm_weight": "self_attention.q_layernorm.weight",
    "self_attention.linear_kv_up_proj.layer_norm_weight": "self_attention.kv_layernorm.weight",
}


def canonical_layer_name(name: str) -> str:
    """A name relative to its layer (``self_attention.linear_qkv.layer_norm_weight``) -> local-spec name."""
    if name in _TE_RENAMES:
        return _TE_RENAMES[name]
    grouped = TE_GROUPED_EXPERT.match(name)
    if grouped:
        return f"mlp.experts.local_experts.{grouped.group(3)}.{grouped.group(1)}.{grouped.group(2)}"
    return name


def without_language_model_prefix(key: str) -> str:
    """``language_model.decoder.layers...`` -> ``decoder.layers...``; any other key unchanged."""
    rest = key.removeprefix(LANGUAGE_MODEL_PREFIX)
    return rest if rest != key and rest.startswith(LANGUAGE_MODEL_ROOTS) else key


def with_prefix(name: str, prefix: str) -> str:
    """A canonical language-model name under ``prefix`` (a table's ``megatron_prefix``); others unchanged."""
    return prefix + name if prefix and name.startswith(LANGUAGE_MODEL_ROOTS) else name


def is_extra_state(name: str) -> bool:
    """``*._extra_state``: module state that is not a weight (FP8 metadata, or None)."""
    return name.endswith(EXTRA_STATE) or f"{EXTRA_STATE}/" in name


def layer_name(layer: int, name: str) -> str:
    return f"decoder.layers.{layer}.{name}"


def expert_name(expert: int, name: str) -> str:
    return f"mlp.experts.local_experts.{expert}.{name}"


def order_key(name: str) -> tuple:
    """Model order: embedding, layers by number (experts by number inside), final norm, output layer."""
    match = LAYER_NAME.match(name)
    if match:
        rest = match.group(2)
        expert = EXPERT_NAME.match(rest)
        return (1, int(match.group(1)), 1 if expert else 0, int(expert.group(1)) if expert else 0)
    if name.startswith("embedding."):
        return (0,)
    if name.startswith("output_layer."):
        return (3,)
    if name.startswith("mtp.layers."):  # after the final norm: MTP layers by number, experts inside
        number, rest = name[len("mtp.layers."):].split(".", 1)
        expert = EXPERT_NAME.match(rest.removeprefix("transformer_layer."))
        return (2, 1, int(number), 1 if expert else 0, int(expert.group(1)) if expert else 0)
    return (2,)


# local-spec modules whose state_dict() has an ``_extra_state`` entry (megatron-core saves it, as None
# when there is nothing to keep)
EXTRA_STATE_MODULES = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "output_layer", "linear_q_proj",
                       "linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj", "linear_kv_up_proj")


def is_mla(names) -> bool:
    """Do these canonical names hold multi-latent attention (DeepSeek)? Its torch_dist keys then keep
    the local-spec norm names: megatron-core's local MLA spec has no TransformerEngine keys map."""
    return any(n.endswith("self_attention.linear_kv_down_proj.weight") for n in names)
