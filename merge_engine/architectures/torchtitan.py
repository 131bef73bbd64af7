"""torchtitan's own parameter names -> the Hub's, per model family: the name tables of torchtitan's state-dict
adapters (``torchtitan/models/<family>/state_dict_adapter.py``, ``from_hf_map``), copied as facts.

Each table maps a torchtitan name (``{}``: the layer number) to its Hub name; torchtitan 0.3.0's names
(``attention.qkv_linear.wq``, ``lm_head``) and those of the releases before it (``attention.wq``, ``output``) are
both listed. ``rope_rows``: the projections whose rows torchtitan keeps in its own RoPE order (Llama 3's complex
RoPE pairs rows ``(2i, 2i + 1)`` of each head, the Hub's rotate-half pairs ``(i, i + head_dim / 2)``): the adapter's
``to_hf`` permutes them, ``w.view(heads, head_dim // 2, 2, cols).transpose(1, 2)``. A family not listed here, or a
name a table does not hold (MoE experts), is refused by name.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_LAYER = re.compile(r"^layers\.([0-9]+)\.(.+)$")


@dataclass(frozen=True)
class TitanTable:
    """One family: torchtitan name -> Hub name, and the Hub projections whose rows are in torchtitan's RoPE order,
    with the config key giving their head count."""

    names: dict[str, str]
    rope_rows: dict[str, str]


_COMMON = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "layers.{}.attention.qkv_linear.wq.weight": "model.layers.{}.self_attn.q_proj.weight",
    "layers.{}.attention.qkv_linear.wk.weight": "model.layers.{}.self_attn.k_proj.weight",
    "layers.{}.attention.qkv_linear.wv.weight": "model.layers.{}.self_attn.v_proj.weight",
    "layers.{}.attention.wq.weight": "model.layers.{}.self_attn.q_proj.weight",
    "layers.{}.attention.wk.weight": "model.layers.{}.self_attn.k_proj.weight",
    "layers.{}.attention.wv.weight": "model.layers.{}.self_attn.v_proj.weight",
    "layers.{}.attention.wo.weight": "model.layers.{}.self_attn.o_proj.weight",
    "layers.{}.feed_forward.w1.weight": "model.layers.{}.mlp.gate_proj.weight",
    "layers.{}.feed_forward.w3.weight": "model.layers.{}.mlp.up_proj.weight",
    "layers.{}.feed_forward.w2.weight": "model.layers.{}.mlp.down_proj.weight",
    "layers.{}.attention_norm.weight": "model.layers.{}.input_layernorm.weight",
    "layers.{}.ffn_norm.weight": "model.layers.{}.post_attention_layernorm.weight",
    "norm.weight": "model.norm.weight",
    "lm_head.weight": "lm_head.weight",
    "output.weight": "lm_head.weight",
}

# config.json's model_type -> its table (torchtitan's llama3 and qwen3 adapters)
TABLES: dict[str, TitanTable] = {
    "llama": TitanTable(dict(_COMMON), rope_rows={"q_proj": "num_attention_heads", "k_proj": "num_key_value_heads"}),
    "qwen3": TitanTable({**_COMMON,
                         "layers.{}.attention.q_norm.weight": "model.layers.{}.self_attn.q_norm.weight",
                         "layers.{}.attention.k_norm.weight": "model.layers.{}.self_attn.k_norm.weight"},
                        rope_rows={}),
}


def hub_name(name: str, table: TitanTable) -> str | None:
    """The Hub name of torchtitan's ``name`` under ``table``; None when the table does not hold it."""
    match = _LAYER.match(name)
    if match is None:
        return table.names.get(name)
    found = table.names.get("layers.{}." + match.group(2))
    return found.format(match.group(1)) if found is not None else None


def rope_heads(hub: str, table: TitanTable) -> str | None:
    """The config key of the head count whose rows ``hub`` keeps in torchtitan's RoPE order; None: as the Hub's."""
    return next((key for module, key in table.rope_rows.items() if f".self_attn.{module}." in hub), None)
