"""Qwen2-MoE: Qwen2 attention (q/k/v bias), a router, routed experts, and one gated shared expert."""

from merge_engine.architectures.families import llama
from merge_engine.architectures.mappings import FamilyTable, GatedMLPMapping

ROUTED_DIRECT = {
    "decoder.layers.*.mlp.router.weight": "model.layers.*.mlp.gate.weight",
    "decoder.layers.*.mlp.experts.local_experts.*.linear_fc2.weight": "model.layers.*.mlp.experts.*.down_proj.weight",
}
ROUTED_GATE_UP = GatedMLPMapping("decoder.layers.*.mlp.experts.local_experts.*.linear_fc1.weight",
                                 gate="model.layers.*.mlp.experts.*.gate_proj.weight",
                                 up="model.layers.*.mlp.experts.*.up_proj.weight")
SHARED_DIRECT = {
    "decoder.layers.*.mlp.shared_experts.linear_fc2.weight": "model.layers.*.mlp.shared_expert.down_proj.weight",
    "decoder.layers.*.mlp.shared_experts.gate_weight": "model.layers.*.mlp.shared_expert_gate.weight",
}

TABLE = FamilyTable(
    name="qwen2_moe",
    model_types=("qwen2_moe",),
    architectures=("Qwen2MoeForCausalLM",),
    direct={**llama.DIRECT, **ROUTED_DIRECT, **SHARED_DIRECT, **llama.DENSE_MLP_DIRECT},
    special=(
        *llama.EMBEDDINGS,
        llama.QKV,
        llama.QKV_BIAS,
        ROUTED_GATE_UP,  # expert e of layer l
        # the shared expert's [gate; up]
        GatedMLPMapping("decoder.layers.*.mlp.shared_experts.linear_fc1.weight",
                        gate="model.layers.*.mlp.shared_expert.gate_proj.weight",
                        up="model.layers.*.mlp.shared_expert.up_proj.weight"),
        llama.GATE_UP,  # dense layers (mlp_only_layers, decoder_sparse_step)
    ),
    experts_keys=("num_experts", "num_local_experts"),
    moe_layer_rule="qwen",  # decoder_sparse_step / mlp_only_layers pick the MoE layers
)
