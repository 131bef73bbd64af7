"""`synthetic_runs.tiny_configs`: a family whose config class states no mrope sections gets its releases' sections,
scaled to the tiny head, so the model runs (Qwen2-VL and Qwen2.5-VL fall back to the full-size [16, 24, 24])."""

from __future__ import annotations

import pytest
import torch


@pytest.mark.parametrize("model_type", ["qwen2_vl", "qwen2_5_vl"])
def test_a_tiny_mrope_model_runs_its_forward(model_type):
    import transformers

    from synthetic_runs.tiny_configs import registry_families, tiny_config

    (family,) = [f for f in registry_families() if f.model_type == model_type]
    data = tiny_config(family, tie_word_embeddings=True)
    config = transformers.AutoConfig.for_model(**data)
    rope = config.get_text_config().rope_parameters
    head = config.get_text_config().hidden_size // config.get_text_config().num_attention_heads
    assert sum(rope["mrope_section"]) == head // 2
    torch.manual_seed(0)
    model = getattr(transformers, family.class_name)(config).eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([[1, 2, 3, 4]])).logits
    assert logits.shape[-1] == config.get_text_config().vocab_size and torch.isfinite(logits).all()
