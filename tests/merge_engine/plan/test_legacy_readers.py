"""`merge_engine.plan.legacy_readers`: a family transformers 4.57 has no model type for is said to be unreadable
by 4.x readers (what ``stepmerge.json`` records); one it knows, nested configs included, gets no note."""

from __future__ import annotations

from merge_engine.plan.legacy_readers import TRANSFORMERS_4_MODEL_TYPES, legacy_reader_note


def test_known_families_get_no_note():
    assert legacy_reader_note({"model_type": "qwen2"}) is None
    assert legacy_reader_note({"model_type": "gemma3", "text_config": {"model_type": "gemma3_text"},
                               "vision_config": {"model_type": "siglip_vision_model"}}) is None
    assert legacy_reader_note({"model_type": "evolla", "protein_encoder_config": {"model_type": ""}}) is None


def test_a_family_new_in_5_is_named_with_its_unknown_types():
    note = legacy_reader_note({"model_type": "kimi_k25", "text_config": {"model_type": "deepseek_v3"}})
    assert note["loads"] is False and note["unknown_model_types"] == ["kimi_k25"]
    assert "kimi_k25" in note["reason"] and "transformers 5" in note["reason"]
    assert legacy_reader_note({"model_type": "qwen3_5_text"})["unknown_model_types"] == ["qwen3_5_text"]


def test_the_table_is_4_57s():
    assert {"llama", "qwen3_next", "qwen3_vl_moe", "gpt_oss", "olmo3"} <= TRANSFORMERS_4_MODEL_TYPES
    assert not {"qwen3_5", "qwen3_5_text", "kimi_k25"} & TRANSFORMERS_4_MODEL_TYPES
