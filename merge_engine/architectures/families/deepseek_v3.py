"""DeepSeek-V3 (and Kimi-K2, same architecture): multi-latent attention, a sigmoid router with a
routing bias, routed and shared experts, the first ``first_k_dense_replace`` layers dense.

MLA is a renaming: megatron-core's low-rank projections hold the rows and columns of the Hugging
Face ones in the same order (``linear_kv_down_proj`` = ``[kv_lora_rank latent; rope key]`` as
``kv_a_proj_with_mqa``; ``linear_q_up_proj`` / ``linear_kv_up_proj`` per head as ``q_b_proj`` /
``kv_b_proj``). The local spec names the low-rank norms ``q_layernorm`` / ``kv_layernorm``; the
TransformerEngine spec fuses them into the up-projections (``linear_q_up_proj.layer_norm_weight``),
which `megatron_names` maps back.
"""

from merge_engine.architectures.families import llama, qwen2_moe
from merge_engine.architectures.mappings import FamilyTable, GatedMLPMapping

MLA_DIRECT = {
    "decoder.layers.*.self_attention.linear_q_down_proj.weight": "model.layers.*.self_attn.q_a_proj.weight",
    "decoder.layers.*.self_attention.q_layernorm.weight": "model.layers.*.self_attn.q_a_layernorm.weight",
    "decoder.layers.*.self_attention.linear_q_up_proj.weight": "model.layers.*.self_attn.q_b_proj.weight",
    "decoder.layers.*.self_attention.linear_kv_down_proj.weight":
        "model.layers.*.self_attn.kv_a_proj_with_mqa.weight",
    "decoder.layers.*.self_attention.kv_layernorm.weight": "model.layers.*.self_attn.kv_a_layernorm.weight",
    "decoder.layers.*.self_attention.linear_kv_up_proj.weight": "model.layers.*.self_attn.kv_b_proj.weight",
}
# sigmoid router: the bias only chooses experts (megatron's expert_bias buffer, fp32)
ROUTER_BIAS_DIRECT = {
    "decoder.layers.*.mlp.router.expert_bias": "model.layers.*.mlp.gate.e_score_correction_bias",
}
SHARED_EXPERTS_DIRECT = {
    "decoder.layers.*.mlp.shared_experts.linear_fc2.weight": "model.layers.*.mlp.shared_experts.down_proj.weight",
}
SHARED_EXPERTS_GATE_UP = GatedMLPMapping("decoder.layers.*.mlp.shared_experts.linear_fc1.weight",
                                         gate="model.layers.*.mlp.shared_experts.gate_proj.weight",
                                         up="model.layers.*.mlp.shared_experts.up_proj.weight")

TABLE = FamilyTable(
    name="deepseek_v3",
    model_types=("deepseek_v3", "kimi_k2"),
    architectures=("DeepseekV3ForCausalLM",),
    direct={**llama.DIRECT, **MLA_DIRECT, **qwen2_moe.ROUTED_DIRECT, **ROUTER_BIAS_DIRECT, **SHARED_EXPERTS_DIRECT,
            **llama.DENSE_MLP_DIRECT},
    special=(
        *llama.EMBEDDINGS,
        qwen2_moe.ROUTED_GATE_UP,  # expert e of layer l
        SHARED_EXPERTS_GATE_UP,  # n_shared_experts fused into one MLP on both sides
        llama.GATE_UP,  # the first_k_dense_replace dense layers
    ),
    experts_keys=("n_routed_experts",),
    moe_layer_rule="first_k_dense",
)
