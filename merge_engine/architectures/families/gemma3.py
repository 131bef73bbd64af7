"""Gemma 3 (text, ``gemma3_text``): Llama's names plus per-head q/k norms and the sandwich norms
around attention and the MLP (``post_attention_layernorm``, ``pre_feedforward_layernorm``,
``post_feedforward_layernorm``). Tied embeddings: no ``lm_head`` in the Hub checkpoint.

Megatron names are those of Megatron-Bridge's Gemma 3 layer spec (the one that builds Gemma 3 in
megatron-core): the post-norms live in the projections (``linear_proj.post_layernorm``,
``linear_fc2.post_layernorm``), the pre-MLP norm in ``linear_fc1`` (TransformerEngine's fused
``layer_norm_weight``, canonical ``pre_mlp_layernorm``). Norm weights are stored as Gemma stores
them (``1 + w`` is applied in the forward pass on both sides), so every entry is a renaming.
"""

from merge_engine.architectures.families import llama, qwen3
from merge_engine.architectures.mappings import FamilyTable

SANDWICH_NORMS_DIRECT = {
    "decoder.layers.*.input_layernorm.weight": "model.layers.*.input_layernorm.weight",
    "decoder.layers.*.self_attention.linear_proj.weight": "model.layers.*.self_attn.o_proj.weight",
    "decoder.layers.*.self_attention.linear_proj.post_layernorm.weight":
        "model.layers.*.post_attention_layernorm.weight",
    "decoder.layers.*.pre_mlp_layernorm.weight": "model.layers.*.pre_feedforward_layernorm.weight",
    "decoder.layers.*.mlp.linear_fc2.weight": "model.layers.*.mlp.down_proj.weight",
    "decoder.layers.*.mlp.linear_fc2.post_layernorm.weight": "model.layers.*.post_feedforward_layernorm.weight",
    "decoder.final_layernorm.weight": "model.norm.weight",
}

TABLE = FamilyTable(
    name="gemma3",
    model_types=("gemma3_text",),
    architectures=("Gemma3ForCausalLM",),
    direct={**SANDWICH_NORMS_DIRECT, **qwen3.QK_NORM_DIRECT},
    special=(
        *llama.EMBEDDINGS,
        llama.QKV,
        llama.GATE_UP,  # GeGLU: [gate; up] like SwiGLU
    ),
)
