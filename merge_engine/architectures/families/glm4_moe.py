"""GLM-4.5 / GLM-4.6 (``glm4_moe``): grouped-query attention with q/k/v bias and optional per-head
q/k norms (partial rotary is a forward-pass setting, not a tensor), then DeepSeek-style MoE: a
sigmoid router with its routing bias, routed and shared experts, the first
``first_k_dense_replace`` layers dense."""

from merge_engine.architectures.families import deepseek_v3, llama, qwen2_moe, qwen3
from merge_engine.architectures.mappings import DirectMapping, FamilyTable, QKVMapping

TABLE = FamilyTable(
    name="glm4_moe",
    model_types=("glm4_moe",),
    architectures=("Glm4MoeForCausalLM",),
    direct={**llama.DIRECT, **qwen2_moe.ROUTED_DIRECT, **deepseek_v3.ROUTER_BIAS_DIRECT,
            **deepseek_v3.SHARED_EXPERTS_DIRECT, **llama.DENSE_MLP_DIRECT},
    special=(
        *llama.EMBEDDINGS,
        llama.QKV,
        # only when config.attention_bias (GLM-4.5: on)
        QKVMapping(llama.QKV_BIAS.megatron, q=llama.QKV_BIAS.q, k=llama.QKV_BIAS.k, v=llama.QKV_BIAS.v,
                   requires="attention_bias"),
        # only when config.use_qk_norm
        *(DirectMapping(m, hf_name=h, requires="use_qk_norm") for m, h in qwen3.QK_NORM_DIRECT.items()),
        qwen2_moe.ROUTED_GATE_UP,  # expert e of layer l
        deepseek_v3.SHARED_EXPERTS_GATE_UP,  # n_shared_experts fused into one MLP on both sides
        llama.GATE_UP,  # the first_k_dense_replace dense layers
    ),
    experts_keys=("n_routed_experts",),
    moe_layer_rule="first_k_dense",
)
