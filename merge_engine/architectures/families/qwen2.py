"""Qwen2: Llama's names plus a bias on q, k and v (always present)."""

from merge_engine.architectures.families import llama
from merge_engine.architectures.mappings import FamilyTable

TABLE = FamilyTable(
    name="qwen2",
    model_types=("qwen2",),
    architectures=("Qwen2ForCausalLM",),
    direct={**llama.DIRECT, **llama.DENSE_MLP_DIRECT},
    special=(
        *llama.EMBEDDINGS,
        llama.QKV,
        llama.QKV_BIAS,  # grouped like the weight rows
        llama.GATE_UP,
    ),
)
