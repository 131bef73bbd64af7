"""`merge_engine.lora.same_model`: a base's config against a LoRA step's, on the keys that define the model only."""

from __future__ import annotations

import os

import pytest
import transformers

from merge_engine.errors import InvalidConfig
from merge_engine.lora.same_model import MODEL_KEYS, check_same_model, model_differences

STEP = transformers.Qwen2Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                                architectures=["Qwen2ForCausalLM"]).to_dict()
BOOKKEEPING = {"_name_or_path": "/elsewhere/base", "transformers_version": "4.0.0", "torch_dtype": "bfloat16",
               "dtype": "bfloat16", "use_cache": False, "bos_token_id": None, "output_hidden_states": True}


def test_a_config_saved_otherwise_is_the_same_model():
    assert model_differences(STEP, {**STEP, **BOOKKEEPING}) == []
    check_same_model(STEP, "/run/step/huggingface", {**STEP, **BOOKKEEPING}, "/models/base")
    without = {k: v for k, v in STEP.items() if k not in ("tie_word_embeddings", "num_key_value_heads")}
    assert model_differences(STEP, without) == []  # a key one side does not state is not compared


@pytest.mark.parametrize("key", [k for k in MODEL_KEYS if k in STEP])
def test_each_model_key_that_differs_is_refused_naming_both_configs(key):
    value = ["LlamaForCausalLM"] if key == "architectures" else "llama" if key == "model_type" else \
        (not STEP[key]) if isinstance(STEP[key], bool) else STEP[key] * 2
    base = {**STEP, **BOOKKEEPING, key: value}
    with pytest.raises(InvalidConfig, match="not the model this run trained") as error:
        check_same_model(STEP, "/run/step/huggingface", base, "/models/other")
    message = error.value.message
    assert f"{key} ({value!r} vs {STEP[key]!r})" in message
    assert os.path.join("/models/other", "config.json") in message
    assert os.path.join("/run/step/huggingface", "config.json") in message
    assert error.value.path == os.path.join("/models/other", "config.json")
    check_same_model(base, "/models/other", base, "/models/other/")  # the step took the base's config: nothing to compare


def test_a_multimodal_configs_language_model_is_compared():
    step = {"architectures": ["Qwen2VLForConditionalGeneration"], "model_type": "qwen2_vl", "text_config": STEP}
    base = {**step, "text_config": {**STEP, "num_hidden_layers": 3}}
    assert model_differences(step, base) == [("text_config.num_hidden_layers", 3, 2)]
    assert model_differences(step, {**step, "text_config": {**STEP, **BOOKKEEPING}}) == []
