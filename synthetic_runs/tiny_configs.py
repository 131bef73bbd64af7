"""Tiny configs of every causal-LM and image-text-to-text family the installed transformers knows.

Contract:
- `registry_families()` -> `RegistryFamily` per (model type, class) of transformers'
  ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` and ``MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES`` (a model type
  both list under one class is one family; under two classes, two), in name order.
- `tiny_config(family)` -> the config as a JSON-able dict: the class's defaults with every size attribute
  shrunk by `SIZE_RULES` (declarative: attribute name -> tiny value), in every nested config; per-layer
  lists (``layer_types``...) cut to the layers kept, which are as few as show each layer type once (run
  lengths of layer kinds, GPT-Neo's ``attention_types``, repeated to them);
  special token ids moved inside the tiny vocabulary; ``architectures`` the family's class; the embeddings tied or
  not as asked (``tie_word_embeddings``, top level and ``text_config``), else as the class's default.
- `stated_tie(config)` -> the ``tie_word_embeddings`` a config states (top level, else ``text_config``), None if none:
  the switch real releases of one family set differently (Qwen2.5-VL-3B ties, the 7B does not).
  `TinyConfigError` says why none could be made (the config class refuses it, the model does not build
  on the meta device, or it has more than `MAX_PARAMETERS` parameters).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

VOCAB = 1003
MAX_LAYERS = 4
MAX_PARAMETERS = 24_000_000
TOKEN_IDS = {"pad_token_id": 0, "bos_token_id": 0, "eos_token_id": 2}  # synthetic_runs.tokenizer's specials

HIDDEN = 64
HEAD_DIM = 16
# attribute name -> tiny value (a callable gets the old value); applied at every level of the config
SIZE_RULES: dict[str, Any] = {
    **dict.fromkeys(("hidden_size", "d_model", "n_embd", "embed_dim", "hidden_dim", "word_embed_proj_dim",
                     "out_hidden_size", "text_hidden_size", "vision_hidden_size", "projector_hidden_size",
                     "projection_dim", "output_dim", "hidden_size_per_layer_input", "d_embed", "n_embed",
                     "mm_hidden_size", "vision_embed_dim", "text_embed_dim", "adapter_hidden_size",
                     "encoder_hidden_size", "cross_attention_hidden_size", "vision_output_dim"), HIDDEN),
    **dict.fromkeys(("intermediate_size", "ffn_dim", "n_inner", "d_ff", "ffn_hidden_size", "encoder_ffn_dim",
                     "decoder_ffn_dim", "mlp_dim", "dense_intermediate_size", "intermediate_size_mlp",
                     "vision_intermediate_size", "text_intermediate_size", "projector_intermediate_size"), 128),
    **dict.fromkeys(("moe_intermediate_size", "shared_expert_intermediate_size", "expert_intermediate_size",
                     "moe_ffn_hidden_size", "shared_intermediate_size"), 32),
    **dict.fromkeys(("num_attention_heads", "n_head", "num_heads", "n_heads", "encoder_attention_heads",
                     "decoder_attention_heads", "attention_heads", "linear_num_value_heads"), 4),
    **dict.fromkeys(("num_key_value_heads", "n_kv_heads", "num_kv_heads", "multi_query_group_num",
                     "linear_num_key_heads", "num_key_value_groups_"), lambda old: 1 if old == 1 else 2),
    **dict.fromkeys(("head_dim", "kv_channels", "attention_head_dim", "linear_key_head_dim",
                     "linear_value_head_dim", "v_head_dim", "qk_nope_head_dim", "global_head_dim",
                     "attention_key_size", "attention_value_size", "d_head", "d_kv"), HEAD_DIM),
    "qk_rope_head_dim": 8,
    **dict.fromkeys(("q_lora_rank", "kv_lora_rank"), lambda old: None if old is None else 32),
    **dict.fromkeys(("num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts", "n_experts"),
                    lambda old: old if not isinstance(old, int) or old <= 1 else 4),
    **dict.fromkeys(("num_experts_per_tok", "moe_topk", "top_k", "num_experts_per_token", "moe_k"),
                    lambda old: old if not isinstance(old, int) or old <= 1 else 2),
    **dict.fromkeys(("n_group", "topk_group", "n_shared_experts"), lambda old: old if old is None else 1),
    **dict.fromkeys(("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len", "seq_length"),
                    lambda old: old if not isinstance(old, int) else min(old, 256)),
    **dict.fromkeys(("sliding_window", "attention_window", "sliding_window_size"),
                    lambda old: old if not isinstance(old, int) or old <= 0 else min(old, 64)),
    **dict.fromkeys(("vocab_size", "text_vocab_size"), lambda old: old if old is None else min(old, VOCAB)),
    **dict.fromkeys(("state_size", "ssm_state_size", "mamba_d_state"), 16),
    **dict.fromkeys(("mamba_n_heads", "mamba_num_heads"), 4),
    **dict.fromkeys(("mamba_head_dim", "mamba_d_head"), 16),
    **dict.fromkeys(("mamba_n_groups", "n_groups", "mamba_ngroups"), 1),
    **dict.fromkeys(("mamba_expand", "expand"), 2),
    "time_step_rank": 8,
    "first_k_dense_replace": lambda old: old if not isinstance(old, int) else min(old, 1),
}
LAYER_COUNTS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "depth", "encoder_layers",
                "decoder_layers", "num_decoder_layers", "num_encoder_layers", "vision_layers", "text_layers")
# per-layer lists whose kinds decide how many layers are kept (every list as long as the layers is cut)
PER_LAYER_LISTS = ("layer_types", "mlp_layer_types", "layers_block_type", "hybrid_override_pattern", "block_types",
                   "attn_type_list", "attention_layers", "layer_group_types")


class TinyConfigError(ValueError):
    """No tiny config of a family could be made; the message says why."""


@dataclass(frozen=True)
class RegistryFamily:
    model_type: str
    class_name: str
    task: str  # "causal_lm" | "image_text_to_text" (the first mapping listing the class)

    @property
    def name(self) -> str:
        return self.model_type if self.class_name.endswith("ForCausalLM") or self.task == "causal_lm" \
            else f"{self.model_type} ({self.class_name})"


def registry_families() -> list[RegistryFamily]:
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
    )

    import transformers

    seen: dict[str, RegistryFamily] = {}  # one family per class: aliases of a model type build the same model
    for task, mapping in (("causal_lm", MODEL_FOR_CAUSAL_LM_MAPPING_NAMES),
                          ("image_text_to_text", MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)):
        for model_type, class_name in mapping.items():
            if isinstance(class_name, (list, tuple)):
                class_name = class_name[0]
            config_class = getattr(getattr(transformers, class_name, None), "config_class", None)
            own = getattr(config_class, "model_type", None)
            known = seen.get(class_name)
            if known is None or (own == model_type and known.model_type != own):
                seen[class_name] = RegistryFamily(model_type, class_name, known.task if known else task)
    return sorted(seen.values(), key=lambda f: (f.model_type, f.task))


def tiny_config(family: RegistryFamily, tie_word_embeddings: bool | None = None) -> dict[str, Any]:
    """The family's tiny config (module docstring); `TinyConfigError` when none can be made. ``tie_word_embeddings``
    (None: the class's default) is set at the top level and in a nested ``text_config``, as a release sets it."""
    import transformers
    from transformers import CONFIG_MAPPING

    if family.model_type not in CONFIG_MAPPING:
        raise TinyConfigError(f"no config class for {family.model_type}")
    if getattr(transformers, family.class_name, None) is None:
        raise TinyConfigError(f"transformers exports no {family.class_name}")
    config_class = getattr(transformers, family.class_name).config_class  # a text-only class of a VLM type: its text config
    try:
        data = config_class().to_dict()
    except Exception as exc:  # noqa: BLE001 - a config class with required arguments has no default to shrink
        raise TinyConfigError(f"{config_class.__name__}() without arguments fails: {_why(exc)}") from None
    data = _shrink(data)
    for scope in _scopes(data):  # latent attention: transformers' head_dim is the rope part (DeepSeek-V3)
        if isinstance(scope.get("qk_rope_head_dim"), int) and isinstance(scope.get("head_dim"), int):
            scope["head_dim"] = scope["qk_rope_head_dim"]
        if isinstance(scope.get("qk_rope_head_dim"), int) and isinstance(scope.get("qk_nope_head_dim"), int) \
                and "qk_head_dim" in scope:
            scope["qk_head_dim"] = scope["qk_rope_head_dim"] + scope["qk_nope_head_dim"]
        if scope.get("kv_lora_rank") and isinstance(scope.get("num_key_value_heads"), int):
            scope["num_key_value_heads"] = scope.get("num_attention_heads")  # one latent KV per head
    _fit_mrope(data)
    _fit_run_lengths(data)
    _tokens_inside(data)
    data["architectures"] = [family.class_name]
    data["model_type"] = config_class.model_type
    data["tie_word_embeddings"] = bool(data.get("tie_word_embeddings", False))
    if tie_word_embeddings is not None:
        for scope in (data, data.get("text_config")):
            if isinstance(scope, dict) and (scope is data or "tie_word_embeddings" in scope):
                scope["tie_word_embeddings"] = tie_word_embeddings
    data = json.loads(json.dumps(data, default=str))
    try:
        config = config_class(**{k: v for k, v in data.items() if k != "model_type"})
    except Exception as exc:  # noqa: BLE001
        raise TinyConfigError(f"{config_class.__name__} refuses the shrunk config: {_why(exc)}") from None
    count = parameter_count(config, family.class_name)
    if count > MAX_PARAMETERS:
        raise TinyConfigError(f"{count:,} parameters after shrinking (cap {MAX_PARAMETERS:,})")
    return json.loads(config.to_json_string(use_diff=False))


def stated_tie(config: dict[str, Any]) -> bool | None:
    """The ``tie_word_embeddings`` ``config`` states (top level, else ``text_config``); None where it states none."""
    for scope in (config, config.get("text_config")):
        if isinstance(scope, dict) and isinstance(scope.get("tie_word_embeddings"), bool):
            return scope["tie_word_embeddings"]
    return None


def parameter_count(config: Any, class_name: str) -> int:
    """Parameters of ``class_name`` built from ``config`` on the meta device (`TinyConfigError` if it fails)."""
    import torch
    import transformers

    try:
        with torch.device("meta"):
            model = getattr(transformers, class_name)._from_config(config)
    except Exception as exc:  # noqa: BLE001
        raise TinyConfigError(f"{class_name} does not build on the meta device: {_why(exc)}") from None
    return sum(p.numel() for p in model.parameters())


def _why(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".replace("\n", " ")[:300]


def _shrink(data: dict[str, Any]) -> dict[str, Any]:
    out = {}
    layers_before = next((data[k] for k in LAYER_COUNTS if isinstance(data.get(k), int)), None)
    layers_after = _layers_kept(data, layers_before)
    for key, value in data.items():
        if isinstance(value, dict) and ((isinstance(key, str) and key.endswith("_config")) or "model_type" in value):
            out[key] = _shrink(value)
        elif key in LAYER_COUNTS and isinstance(value, int) and not isinstance(value, bool):
            out[key] = min(value, layers_after) if layers_after else min(value, 2)
        elif key in SIZE_RULES and value is not None and not isinstance(value, (bool, dict)):
            out[key] = [_sized(key, v) for v in value] if isinstance(value, list) else _sized(key, value)
        else:
            out[key] = value
    if layers_before and layers_after and layers_after < layers_before:
        for key, value in out.items():
            if isinstance(value, (list, str)) and len(value) == layers_before and key not in LAYER_COUNTS:
                out[key] = value[:layers_after]  # one entry per layer
            elif isinstance(value, dict) and value and all(_is_index(k) for k in value):
                out[key] = {k: v for k, v in value.items() if int(k) < layers_after}  # per-layer settings by index
    return out


def _sized(key: str, value: Any) -> Any:
    rule = SIZE_RULES[key]
    if callable(rule):
        return rule(value)
    return rule if isinstance(value, int) and not isinstance(value, bool) else value


def _is_index(key: Any) -> bool:
    return isinstance(key, int) or (isinstance(key, str) and key.isdigit())


def _layers_kept(data: dict[str, Any], before: int | None) -> int | None:
    """As few layers as show each layer type (``layer_types`` or the like) once, at least 2, at most 4."""
    if before is None:
        return None
    kept = 2
    for key in PER_LAYER_LISTS:
        value = data.get(key)
        if isinstance(value, (list, str)) and len(value) == before and len(value):
            firsts = {}
            for index, kind in enumerate(value):
                firsts.setdefault(json.dumps(kind, default=str), index)
            kept = max(kept, max(firsts.values()) + 1)
    return min(before, min(kept, MAX_LAYERS))


# The mrope sections a family's releases ship where its config class has none (the model code falls back to the
# full-size sections, which do not fit a tiny head): Qwen2-VL-2B/7B and Qwen2.5-VL-3B/7B config.json.
RELEASE_MROPE_SECTIONS: dict[str, list[int]] = {"qwen2_vl": [16, 24, 24], "qwen2_5_vl": [16, 24, 24]}


def _fit_mrope(data: dict[str, Any]) -> None:
    """mrope sections sum to half the head dim: scaled to the tiny head dim, in the same proportions."""
    release_section = RELEASE_MROPE_SECTIONS.get(str(data.get("model_type")))
    if release_section is not None:
        text = data.get("text_config") if isinstance(data.get("text_config"), dict) else data
        rope = text.setdefault("rope_parameters", {"rope_type": "default"})
        if isinstance(rope, dict):
            rope.setdefault("mrope_section", list(release_section))
    for scope in _scopes(data):
        for holder in (scope, scope.get("rope_parameters"), scope.get("rope_scaling")):
            if isinstance(holder, dict) and isinstance(holder.get("mrope_section"), list):
                section = holder["mrope_section"]
                heads = scope.get("num_attention_heads") or 4
                head = scope.get("head_dim") or (scope.get("hidden_size") or HIDDEN) // heads
                half, total = head // 2, sum(section) or 1
                scaled = [max(1, s * half // total) for s in section]
                scaled[0] += half - sum(scaled)
                holder["mrope_section"] = scaled


def _fit_run_lengths(data: dict[str, Any]) -> None:
    """Layer kinds given as run lengths (GPT-Neo's ``attention_types``: ``[[["global", "local"], 12]]``) repeated
    to the layers kept, as a real config's agree with its layer count (transformers 4.57 checks they do)."""
    for scope in _scopes(data):
        runs = scope.get("attention_types")
        layers = next((scope[k] for k in LAYER_COUNTS if isinstance(scope.get(k), int)), None)
        if not (isinstance(runs, list) and len(runs) == 1 and isinstance(runs[0], list) and len(runs[0]) == 2
                and isinstance(runs[0][0], list) and runs[0][0] and isinstance(layers, int)):
            continue
        kinds = runs[0][0]
        if len(kinds) * runs[0][1] != layers and layers % len(kinds) == 0:
            scope["attention_types"] = [[kinds, layers // len(kinds)]]


def _scopes(data: dict[str, Any]):
    yield data
    for value in data.values():
        if isinstance(value, dict):
            yield from _scopes(value)


def _tokens_inside(data: dict[str, Any]) -> None:
    """Special token ids inside the tiny vocabulary: pad/bos/eos the tokenizer's, the rest at its top."""
    top = VOCAB - 1
    for scope in _scopes(data):
        for key, value in list(scope.items()):
            if key in TOKEN_IDS and (value is None or isinstance(value, int)):
                scope[key] = TOKEN_IDS[key] if value is not None else None
            elif isinstance(key, str) and (key.endswith(("_token_id", "_token_index", "_token_idx")) or key == "image_token_id") and \
                    isinstance(value, int) and not isinstance(value, bool) and value >= VOCAB:
                scope[key] = top
                top -= 1
