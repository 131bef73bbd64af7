"""PEFT's names and config semantics, checked against peft's own functions and loading."""

from __future__ import annotations

import pytest

from merge_engine.errors import AdapterError
from merge_engine.lora.config import (
    LoraSettings,
    infer_target_modules,
    pattern_key,
    rank_layout,
    scaling,
    targets,
)
from merge_engine.lora.keys import BASE, LORA_A, LORA_B, TRAINED_COPY, adapter_file_key, parse_key

MODULES = [f"model.layers.{i}.{part}" for i in (0, 1, 11, 21) for part in (
    "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj")]


@pytest.mark.parametrize("key, kind, name, embedding, adapter", [
    ("base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight", BASE,
     "model.layers.0.self_attn.q_proj.weight", False, None),
    ("base_model.model.model.layers.0.self_attn.q_proj.base_layer.bias", BASE,
     "model.layers.0.self_attn.q_proj.bias", False, None),
    ("base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight", LORA_A,
     "model.layers.0.self_attn.q_proj", False, "default"),
    ("base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight", LORA_B,
     "model.layers.0.self_attn.q_proj", False, None),
    ("base_model.model.model.embed_tokens.lora_embedding_A.default", LORA_A, "model.embed_tokens", True, "default"),
    ("base_model.model.model.embed_tokens.lora_embedding_B", LORA_B, "model.embed_tokens", True, None),
    ("base_model.model.lm_head.modules_to_save.default.weight", TRAINED_COPY, "lm_head.weight", False, "default"),
    ("base_model.model.lm_head.original_module.weight", BASE, "lm_head.weight", False, None),
    ("base_model.model.model.norm.weight", BASE, "model.norm.weight", False, None),
])
def test_parse_key_reads_both_spellings(key, kind, name, embedding, adapter):
    """Training-checkpoint and adapter-file keys map to (role, Hugging Face name)."""
    role = parse_key(key)
    assert (role.kind, role.name, role.embedding, role.adapter) == (kind, name, embedding, adapter)


@pytest.mark.parametrize("key", ["base_model.model.model.layers.0.mlp.up_proj.lora_magnitude_vector.default.weight",
                                 "base_model.model.model.layers.0.mlp.up_proj.lora_B.default.bias",
                                 "base_model.model.model.layers.0.mlp.up_proj.lora_E.default"])
def test_parse_key_refuses_variants_it_cannot_fuse(key):
    """DoRA magnitudes, LoRA biases and unknown LoRA tensors are named errors, never ignored."""
    with pytest.raises(AdapterError):
        parse_key(key)


def test_adapter_file_keys_are_peft_names():
    assert adapter_file_key("model.layers.0.mlp.up_proj", "lora_A", False) == \
        "base_model.model.model.layers.0.mlp.up_proj.lora_A.weight"
    assert adapter_file_key("model.embed_tokens", "lora_B", True) == "base_model.model.model.embed_tokens.lora_embedding_B"


def test_pattern_key_is_peft_get_pattern_key():
    """First matching key wins, matched as peft matches it, for every module."""
    from peft.utils.other import get_pattern_key

    patterns = ["layers.1.self_attn.q_proj", "q_proj", "mlp.*_proj", "model.layers.11.self_attn.k_proj"]
    for module in MODULES:
        ours = pattern_key(patterns, module)
        assert (ours if ours is not None else module) == get_pattern_key(patterns, module)


@pytest.mark.parametrize("target", [["q_proj", "v_proj"], ["self_attn.o_proj"], r".*layers\.1\..*proj", ["up"]])
def test_targets_is_peft_target_matching(target):
    """target_modules selects the same modules as peft's check_target_module_exists."""
    from peft import LoraConfig
    from peft.tuners.tuners_utils import check_target_module_exists

    config = LoraConfig(target_modules=target)
    for module in MODULES:
        assert targets(config.target_modules, module) == bool(check_target_module_exists(config, module))


def test_scaling_is_alpha_over_r_or_sqrt_r():
    assert scaling(16, 4, False) == 4.0
    assert scaling(16, 4, True) == 8.0
    settings = LoraSettings.from_config({"r": 8, "lora_alpha": 16, "rank_pattern": {"q_proj": 4},
                                         "alpha_pattern": {"layers.1.self_attn.q_proj": 2}})
    assert settings.rank_of("model.layers.0.self_attn.q_proj") == 4
    assert settings.alpha_of("model.layers.0.self_attn.q_proj") == 16
    assert settings.alpha_of("model.layers.1.self_attn.q_proj") == 2
    assert settings.scale_of("model.layers.1.self_attn.q_proj", 4) == 0.5


@pytest.mark.parametrize("field, value", [("use_dora", True), ("lora_bias", True), ("peft_type", "IA3")])
def test_unsupported_settings_are_refused(field, value):
    with pytest.raises(AdapterError):
        LoraSettings.from_config({"r": 4, "lora_alpha": 8, field: value})


def test_target_parameters_are_read():
    """LoRA on fused expert tensors is plain LoRA per expert (tests/merge_engine/lora/test_fused_experts.py)."""
    settings = LoraSettings.from_config({"r": 4, "lora_alpha": 8, "target_parameters": ["mlp.experts.gate_up_proj"]})
    assert settings.target_parameters == ("mlp.experts.gate_up_proj",)


def test_rank_layout_round_trips_through_peft(tiny_base):
    """Inferred (r, rank_pattern), given to peft, rebuild exactly the per-module ranks."""
    import peft

    from tests.merge_engine.lora.conftest import load_causal_lm

    ranks = {m: 4 for m in ("model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.q_proj",
                            "model.layers.0.self_attn.v_proj")}
    ranks["model.layers.1.self_attn.v_proj"] = 2
    ranks["model.layers.0.mlp.down_proj"] = 7
    r, pattern = rank_layout(ranks)
    assert r == 4 and set(pattern) == {"model.layers.1.self_attn.v_proj", "model.layers.0.mlp.down_proj"}
    target = infer_target_modules(ranks, {f"model.layers.{i}.{p}" for i in (0, 1) for p in
                                          ("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj")})
    assert target == sorted(ranks)  # down_proj of layer 1 is not adapted: short names would select it
    model = peft.get_peft_model(load_causal_lm(tiny_base), peft.LoraConfig(r=r, lora_alpha=8, target_modules=target,
                                                                           rank_pattern=pattern))
    built = {name.removeprefix("base_model.model.").removesuffix(".lora_A.default.weight"): p.shape[0]
             for name, p in model.named_parameters() if name.endswith("lora_A.default.weight")}
    assert built == ranks


def test_infer_target_modules_prefers_short_names():
    modules = [f"model.layers.{i}.self_attn.{p}" for i in (0, 1) for p in ("q_proj", "v_proj")]
    candidates = set(modules) | {"model.layers.0.mlp.up_proj"}
    assert infer_target_modules(modules, candidates) == ["q_proj", "v_proj"]


def test_rank_layout_needs_modules():
    with pytest.raises(AdapterError):
        rank_layout({})
