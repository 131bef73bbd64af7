"""Tiny configs of the architectures verl users train beyond the dense Qwen2/Llama of `models`.

One declarative entry per family: the config class, the causal-LM class, the decoder layer FSDP
wraps, and the family's own config fields on top of the shared sizes of a `ModelSpec`. The MoE and
vision-language families are the ones transformers v5 holds under other names in memory than on
the Hub (fused experts, ``model.language_model``); GPT-NeoX names its head ``embed_out`` on the Hub
and GPT-2 ties ``lm_head`` to ``wte`` and stores Conv1D weights as (in, out). gpt-oss (fused experts
with biases, attention sinks, sliding and full attention layers) and Qwen3-VL / Qwen3-VL-MoE
(deepstack vision tower, interleaved mrope) keep their in-memory names on the Hub: their merge is
checked against ``save_pretrained`` like the others.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

NUM_EXPERTS = 4
EXPERTS_PER_TOKEN = 2


@dataclass(frozen=True)
class Family:
    config_class: str
    causal_lm: str  # the class config.json names in `architectures`
    decoder_layer: str  # the class FSDP wraps per layer (the model's `_no_split_modules`)
    fields: Callable[[Any], dict[str, Any]]  # spec -> the family's config kwargs (sizes included)


def _llama_like(spec: Any) -> dict[str, Any]:
    return dict(vocab_size=spec.vocab_size, hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
                num_hidden_layers=spec.num_layers, num_attention_heads=spec.num_heads,
                num_key_value_heads=spec.num_kv_heads, max_position_embeddings=256, rms_norm_eps=1e-6,
                tie_word_embeddings=spec.tie_word_embeddings)


def _mixtral(spec: Any) -> dict[str, Any]:
    return {**_llama_like(spec), "num_local_experts": NUM_EXPERTS, "num_experts_per_tok": EXPERTS_PER_TOKEN}


def _qwen3_moe(spec: Any) -> dict[str, Any]:
    return {**_llama_like(spec), "num_experts": NUM_EXPERTS, "num_experts_per_tok": EXPERTS_PER_TOKEN,
            "moe_intermediate_size": spec.intermediate_size // 2, "head_dim": spec.hidden_size // spec.num_heads,
            "norm_topk_prob": True}


def _qwen2_moe(spec: Any) -> dict[str, Any]:
    return {**_llama_like(spec), "num_experts": NUM_EXPERTS, "num_experts_per_tok": EXPERTS_PER_TOKEN,
            "moe_intermediate_size": spec.intermediate_size // 2,
            "shared_expert_intermediate_size": spec.intermediate_size}


def _deepseek_v3(spec: Any) -> dict[str, Any]:
    head = spec.hidden_size // spec.num_heads
    return {**_llama_like(spec), "num_key_value_heads": spec.num_heads, "n_routed_experts": NUM_EXPERTS,
            "num_experts_per_tok": EXPERTS_PER_TOKEN, "moe_intermediate_size": spec.intermediate_size // 2,
            "n_shared_experts": 1, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1,
            "q_lora_rank": 2 * head, "kv_lora_rank": 2 * head, "qk_rope_head_dim": head // 2,
            "qk_nope_head_dim": head, "v_head_dim": head, "rope_scaling": None}


def _text_config(spec: Any) -> dict[str, Any]:
    fields = _llama_like(spec)
    fields.pop("tie_word_embeddings")
    head = spec.hidden_size // spec.num_heads
    half = head // 2  # mrope sections (temporal, height, width) cover half the head dim
    section = [half // 4, (half - half // 4) // 2, half - half // 4 - (half - half // 4) // 2]
    return {**fields, "rope_scaling": {"type": "mrope", "mrope_section": section}}


def _qwen2_vl(spec: Any) -> dict[str, Any]:
    vision = dict(depth=1, embed_dim=32, hidden_size=spec.hidden_size, num_heads=4, mlp_ratio=2, patch_size=14,
                  spatial_merge_size=2, temporal_patch_size=2, in_channels=3)
    return dict(text_config=_text_config(spec), vision_config=vision, tie_word_embeddings=spec.tie_word_embeddings)


def _qwen2_5_vl(spec: Any) -> dict[str, Any]:
    vision = dict(depth=1, hidden_size=32, intermediate_size=48, out_hidden_size=spec.hidden_size, num_heads=4,
                  patch_size=14, spatial_merge_size=2, temporal_patch_size=2, in_channels=3, window_size=56,
                  fullatt_block_indexes=[0])
    return dict(text_config=_text_config(spec), vision_config=vision, tie_word_embeddings=spec.tie_word_embeddings)


def _gpt_oss(spec: Any) -> dict[str, Any]:
    fields = _llama_like(spec)
    fields.pop("rms_norm_eps")
    layer_types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(spec.num_layers)]
    return {**fields, "intermediate_size": spec.intermediate_size // 2, "head_dim": spec.hidden_size // spec.num_heads,
            "num_local_experts": NUM_EXPERTS, "num_experts_per_tok": EXPERTS_PER_TOKEN, "sliding_window": 8,
            "layer_types": layer_types, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}


def _qwen3_vl_text(spec: Any) -> dict[str, Any]:
    fields = _llama_like(spec)
    fields.pop("tie_word_embeddings")
    head = spec.hidden_size // spec.num_heads
    half = head // 2
    section = [half // 4, (half - half // 4) // 2, half - half // 4 - (half - half // 4) // 2]
    return {**fields, "head_dim": head, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                            "mrope_section": section, "mrope_interleaved": True}}


QWEN3_VL_VISION = dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=4, patch_size=16, spatial_merge_size=2,
                       temporal_patch_size=2, in_channels=3, deepstack_visual_indexes=[0], num_position_embeddings=16)


def _qwen3_vl(spec: Any) -> dict[str, Any]:
    return dict(text_config=_qwen3_vl_text(spec), vision_config={**QWEN3_VL_VISION, "out_hidden_size": spec.hidden_size},
                tie_word_embeddings=spec.tie_word_embeddings)


def _qwen3_vl_moe(spec: Any) -> dict[str, Any]:
    text = {**_qwen3_vl_text(spec), "num_experts": NUM_EXPERTS, "num_experts_per_tok": EXPERTS_PER_TOKEN,
            "moe_intermediate_size": spec.intermediate_size // 2, "decoder_sparse_step": 1}
    return dict(text_config=text, vision_config={**QWEN3_VL_VISION, "out_hidden_size": spec.hidden_size},
                tie_word_embeddings=spec.tie_word_embeddings)


def _gpt_neox(spec: Any) -> dict[str, Any]:
    return dict(vocab_size=spec.vocab_size, hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
                num_hidden_layers=spec.num_layers, num_attention_heads=spec.num_heads, max_position_embeddings=256,
                tie_word_embeddings=spec.tie_word_embeddings, rotary_pct=0.5)


def _gpt2(spec: Any) -> dict[str, Any]:
    return dict(vocab_size=spec.vocab_size, n_embd=spec.hidden_size, n_inner=spec.intermediate_size,
                n_layer=spec.num_layers, n_head=spec.num_heads, n_positions=256,
                tie_word_embeddings=spec.tie_word_embeddings)


FAMILIES: dict[str, Family] = {
    "mixtral": Family("MixtralConfig", "MixtralForCausalLM", "MixtralDecoderLayer", _mixtral),
    "qwen3_moe": Family("Qwen3MoeConfig", "Qwen3MoeForCausalLM", "Qwen3MoeDecoderLayer", _qwen3_moe),
    "qwen2_moe": Family("Qwen2MoeConfig", "Qwen2MoeForCausalLM", "Qwen2MoeDecoderLayer", _qwen2_moe),
    "deepseek_v3": Family("DeepseekV3Config", "DeepseekV3ForCausalLM", "DeepseekV3DecoderLayer", _deepseek_v3),
    "qwen2_vl": Family("Qwen2VLConfig", "Qwen2VLForConditionalGeneration", "Qwen2VLDecoderLayer", _qwen2_vl),
    "qwen2_5_vl": Family("Qwen2_5_VLConfig", "Qwen2_5_VLForConditionalGeneration", "Qwen2_5_VLDecoderLayer",
                         _qwen2_5_vl),
    "qwen3_vl": Family("Qwen3VLConfig", "Qwen3VLForConditionalGeneration", "Qwen3VLTextDecoderLayer", _qwen3_vl),
    "qwen3_vl_moe": Family("Qwen3VLMoeConfig", "Qwen3VLMoeForConditionalGeneration", "Qwen3VLMoeTextDecoderLayer",
                           _qwen3_vl_moe),
    "gpt_oss": Family("GptOssConfig", "GptOssForCausalLM", "GptOssDecoderLayer", _gpt_oss),
    "gpt_neox": Family("GPTNeoXConfig", "GPTNeoXForCausalLM", "GPTNeoXLayer", _gpt_neox),
    "gpt2": Family("GPT2Config", "GPT2LMHeadModel", "GPT2Block", _gpt2),
}


def build_family_config(spec: Any, token_ids: dict[str, int]):
    """The transformers config of a `ModelSpec` whose family is in `FAMILIES`."""
    import transformers

    family = FAMILIES[spec.family]
    config = getattr(transformers, family.config_class)(**family.fields(spec), **token_ids)
    config.architectures = [family.causal_lm]
    return config
