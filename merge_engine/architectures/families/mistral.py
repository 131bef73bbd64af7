"""Mistral: Llama's names exactly (sliding-window attention changes no tensor)."""

from merge_engine.architectures.families import llama
from merge_engine.architectures.mappings import FamilyTable

TABLE = FamilyTable(
    name="mistral",
    model_types=("mistral",),
    architectures=("MistralForCausalLM",),
    direct={**llama.DIRECT, **llama.DENSE_MLP_DIRECT},
    special=(
        *llama.EMBEDDINGS,
        llama.QKV,
        llama.GATE_UP,
    ),
)
