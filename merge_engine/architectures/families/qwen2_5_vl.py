"""Qwen2.5-VL: a Qwen2 language model plus the vision tower and its merger (the projector).

Megatron names are Megatron-Bridge's (``qwen25_vl_bridge.py``; megatron-core 0.16.1 cannot build
this model: ``ValueError: Vision model qwen2_5_vl is not supported.``). The language model is
Qwen2's table under ``language_model.`` in the checkpoint (`FamilyTable.megatron_prefix`; the
readers strip it, so the canonical names are Qwen2's); the vision tower is Hugging Face's own
module inside the Megatron model, replicated on every TP rank, so its names are the Hub names
(``visual.**`` -> ``visual.**``, Bridge's ``ReplicatedMapping``). ``visual.blocks.*`` counts
``vision_config.depth`` blocks.
"""

from merge_engine.architectures.families import qwen2
from merge_engine.architectures.mappings import FamilyTable

VISION_BLOCK = ("norm1.weight", "norm2.weight", "attn.qkv.weight", "attn.qkv.bias", "attn.proj.weight",
                "attn.proj.bias", "mlp.gate_proj.weight", "mlp.gate_proj.bias", "mlp.up_proj.weight",
                "mlp.up_proj.bias", "mlp.down_proj.weight", "mlp.down_proj.bias")
VISION_GLOBAL = ("patch_embed.proj.weight", "merger.ln_q.weight", "merger.mlp.0.weight", "merger.mlp.0.bias",
                 "merger.mlp.2.weight", "merger.mlp.2.bias")
# the same name on both sides (Megatron-Bridge keeps Hugging Face's vision module)
VISION_DIRECT = {**{f"visual.blocks.*.{n}": f"visual.blocks.*.{n}" for n in VISION_BLOCK},
                 **{f"visual.{n}": f"visual.{n}" for n in VISION_GLOBAL}}

TABLE = FamilyTable(
    name="qwen2_5_vl",
    model_types=("qwen2_5_vl",),
    architectures=("Qwen2_5_VLForConditionalGeneration",),
    direct={**qwen2.TABLE.direct, **VISION_DIRECT},
    special=qwen2.TABLE.special,
    megatron_prefix="language_model.",
)
