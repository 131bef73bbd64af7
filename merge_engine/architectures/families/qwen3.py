"""Qwen3: Llama's names plus per-head RMSNorm on queries and keys (q_norm / k_norm)."""

from merge_engine.architectures.families import llama
from merge_engine.architectures.mappings import FamilyTable, QKVMapping

QK_NORM_DIRECT = {
    "decoder.layers.*.self_attention.q_layernorm.weight": "model.layers.*.self_attn.q_norm.weight",
    "decoder.layers.*.self_attention.k_layernorm.weight": "model.layers.*.self_attn.k_norm.weight",
}

TABLE = FamilyTable(
    name="qwen3",
    model_types=("qwen3",),
    architectures=("Qwen3ForCausalLM",),
    direct={**llama.DIRECT, **QK_NORM_DIRECT, **llama.DENSE_MLP_DIRECT},
    special=(
        *llama.EMBEDDINGS,
        llama.QKV,
        # only when config.attention_bias
        QKVMapping(llama.QKV_BIAS.megatron, q=llama.QKV_BIAS.q, k=llama.QKV_BIAS.k, v=llama.QKV_BIAS.v,
                   requires="attention_bias"),
        llama.GATE_UP,
    ),
)
