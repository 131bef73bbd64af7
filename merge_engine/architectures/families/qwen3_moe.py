"""Qwen3-MoE: Qwen3 attention (q_norm / k_norm), a router and routed experts; no shared expert."""

from merge_engine.architectures.families import llama, qwen2_moe, qwen3
from merge_engine.architectures.mappings import FamilyTable

TABLE = FamilyTable(
    name="qwen3_moe",
    model_types=("qwen3_moe",),
    architectures=("Qwen3MoeForCausalLM",),
    direct={**llama.DIRECT, **qwen3.QK_NORM_DIRECT, **qwen2_moe.ROUTED_DIRECT, **llama.DENSE_MLP_DIRECT},
    special=(
        *llama.EMBEDDINGS,
        llama.QKV,
        qwen2_moe.ROUTED_GATE_UP,  # expert e of layer l
        llama.GATE_UP,  # dense layers (mlp_only_layers, decoder_sparse_step)
    ),
    experts_keys=("num_experts", "num_local_experts"),
    moe_layer_rule="qwen",
)
