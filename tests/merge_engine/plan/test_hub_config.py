"""The Hub form of config.json: transformers 5's config plus the keys transformers 4.x reads.

Specification (issue 16, item 3; whether 4.57 then loads the folders: test_hub_readers.py):
- Qwen3-MoE (and Qwen3-VL-MoE's text config) get ``num_experts`` beside ``num_local_experts``: the
  alias is a field of the config class (``attribute_map``); Mixtral's alias is not a field: not written.
- The rope settings are written as 4.x spelled them, learnt from each class's own standardisation:
  ``rope_theta`` + ``rope_scaling`` (``null`` for the default rope, explicit), GPT-NeoX's
  ``rotary_emb_base`` / ``rotary_pct``; Qwen2-VL / Qwen2.5-VL / Qwen3-VL in ``text_config``, with the
  mrope sections.
- A vision-language model's top-level tie flag is copied into its text config.
- Nothing is removed and transformers 5 reads the result exactly as it read the input.
- A config already in the Hub's form, and a model type transformers does not know, are left alone.
"""

from __future__ import annotations

import pytest

from merge_engine.plan.hub_config import hub_config, rope_spelling
from synthetic_runs.model_families import FAMILIES
from synthetic_runs.models import ModelSpec, build_config

ALL_FAMILIES = sorted(FAMILIES) + ["llama", "qwen2"]


def _v5_config(family: str, **spec) -> dict:
    """The config.json transformers 5's save_pretrained writes for the family."""
    return build_config(ModelSpec(family=family, **spec)).to_diff_dict()


def _hub(config: dict) -> dict:
    translated = hub_config(config)
    return {**config, **translated.updates}


def _changed(family: str) -> dict[str, object]:
    return {c.key: c.value for c in hub_config(_v5_config(family)).changes}


def test_qwen3_moe_gets_num_experts():
    config = _v5_config("qwen3_moe")
    assert "num_experts" not in config and config["num_local_experts"] == 4  # what 4.57 reads as 128 experts
    translated = hub_config(config)
    assert _hub(config)["num_experts"] == 4
    change = next(c for c in translated.changes if c.key == "num_experts")
    assert "Qwen3MoeConfig.attribute_map" in change.source


def test_an_alias_that_is_not_a_field_is_not_written():
    """Mixtral's field is num_local_experts (the Hub's key); num_experts is only attribute sugar."""
    assert "num_experts" not in _changed("mixtral")
    assert "text_config.num_experts" in _changed("qwen3_vl_moe")


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl"])
def test_vision_language_rope_and_tie_flag_in_the_text_config(family):
    for tied in (False, True):
        config = _v5_config(family, tie_word_embeddings=tied)
        text = _hub(config)["text_config"]
        assert text["rope_theta"] == config["text_config"]["rope_parameters"]["rope_theta"]
        assert text["rope_scaling"]["mrope_section"] == config["text_config"]["rope_parameters"]["mrope_section"]
        assert text["tie_word_embeddings"] is tied
        assert "rope_parameters" in text  # kept for transformers 5


def test_gpt_neox_rope_under_its_own_legacy_names():
    """GPT-NeoX's standardisation reads rotary_emb_base / rotary_pct: found by running it."""
    changed = _changed("gpt_neox")
    assert changed["rotary_pct"] == 0.5 and changed["rotary_emb_base"] == 10000.0
    assert "rope_theta" not in changed


def test_default_rope_is_written_explicitly_as_null():
    """gpt-oss's 4.57 class defaults to a yarn rope: the default rope must be said, not implied."""
    changed = _changed("gpt_oss")
    assert "rope_scaling" in changed and changed["rope_scaling"] is None
    assert changed["rope_theta"] == 10000.0


def test_rope_spelling_comes_from_the_class():
    import transformers

    neox = transformers.GPTNeoXConfig()
    spelling = rope_spelling(neox)
    assert spelling.keys == {"rotary_emb_base": "rope_theta", "rotary_pct": "partial_rotary_factor"}
    assert spelling.carrier == "rope_scaling"
    assert rope_spelling(transformers.LlamaConfig()).keys["rope_theta"] == "rope_theta"


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_nothing_removed_and_transformers_5_reads_the_same(family):
    from transformers import AutoConfig

    config = _v5_config(family)
    translated = _hub(config)

    def kept(before: dict, after: dict, path: str = "") -> None:
        for key, value in before.items():
            if f"{path}{key}" == "text_config.tie_word_embeddings":
                continue  # mirrored from the top level on purpose
            if isinstance(value, dict) and key != "rope_parameters":
                kept(value, after[key], f"{path}{key}.")
            else:
                assert after[key] == value, f"{path}{key}"

    kept(config, translated)

    def read(data):
        data = dict(data)
        out = AutoConfig.for_model(data.pop("model_type"), **data).to_dict()
        out.pop("transformers_version")
        out.get("text_config", {}).pop("tie_word_embeddings", None)
        return out

    assert read(translated) == read(config)


def test_a_config_in_the_hub_form_is_left_alone():
    """A 4.x-era Qwen3-MoE config (num_experts, rope_theta, rope_scaling null) needs nothing."""
    config = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "num_experts": 4,
              "num_experts_per_tok": 2, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "intermediate_size": 112, "moe_intermediate_size": 56, "vocab_size": 1003,
              "rope_theta": 10000.0, "rope_scaling": None}
    translated = hub_config(config)
    assert translated.changes == () and translated.updates == {}


def test_unknown_model_type_is_left_alone():
    translated = hub_config({"model_type": "not_a_transformers_model", "architectures": ["X"]})
    assert translated.changes == () and translated.updates == {}
    assert "not_a_transformers_model" in translated.describe()


def _olmo3(**rope) -> dict:
    from transformers import Olmo3Config

    config = Olmo3Config(vocab_size=1003, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, rope_parameters=rope or None).to_diff_dict()
    config["model_type"] = "olmo3"
    return config


def test_rope_per_layer_type_is_written_when_the_legacy_keys_give_it_back():
    """OLMo-3 (one theta for both layer types): rope_theta and rope_scaling, as its own standardisation reads
    them (what 4.57 runs); other thetas per layer type have no 4.x form: nothing written."""
    config = _olmo3()
    theta = config["rope_parameters"]["full_attention"]["rope_theta"]
    assert config["rope_parameters"]["sliding_attention"]["rope_theta"] == theta
    changes = {c.key: c for c in hub_config(config).changes}
    assert changes["rope_theta"].value == theta and changes["rope_scaling"].value is None
    assert "per layer type; read back equal" in changes["rope_theta"].source
    different = _olmo3(full_attention={"rope_type": "default", "rope_theta": 500000.0},
                       sliding_attention={"rope_type": "default", "rope_theta": 10000.0})
    assert not {"rope_theta", "rope_scaling"} & {c.key for c in hub_config(different).changes}
