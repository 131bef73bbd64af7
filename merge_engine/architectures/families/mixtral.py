"""Mixtral: Llama attention, a router and routed experts under ``block_sparse_moe`` (w1 gate, w3 up, w2 down).

Hub names, which every transformers version loads (transformers 5 fuses the experts in memory
and writes these names back on save).
"""

from merge_engine.architectures.families import llama
from merge_engine.architectures.mappings import FamilyTable, GatedMLPMapping

MOE_DIRECT = {
    "decoder.layers.*.mlp.router.weight": "model.layers.*.block_sparse_moe.gate.weight",
    "decoder.layers.*.mlp.experts.local_experts.*.linear_fc2.weight": "model.layers.*.block_sparse_moe.experts.*.w2.weight",
}

TABLE = FamilyTable(
    name="mixtral",
    model_types=("mixtral",),
    architectures=("MixtralForCausalLM",),
    direct={**llama.DIRECT, **MOE_DIRECT},
    special=(
        *llama.EMBEDDINGS,
        llama.QKV,
        # expert e of layer l: [gate; up] -> w1 (gate), w3 (up)
        GatedMLPMapping("decoder.layers.*.mlp.experts.local_experts.*.linear_fc1.weight",
                        gate="model.layers.*.block_sparse_moe.experts.*.w1.weight",
                        up="model.layers.*.block_sparse_moe.experts.*.w3.weight"),
    ),
    experts_keys=("num_local_experts", "num_experts"),
)
