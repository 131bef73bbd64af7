"""`merge_engine.plan.config_shapes`: config.json checked against the tensors by transformers' own model of it.

Specification: a config agreeing with the tensors passes (GQA heads, explicit head_dim, biases, tied
models without lm_head, Qwen3-Next's gated q_proj and linear-attention layers, DeepSeek's latent attention
and its multi-token-prediction layer, per-expert Hub names and fused in-memory ones); each contradiction
(vocab, hidden size, KV heads, intermediate size, heads of a gated attention, layer count either way)
raises `InvalidConfig` naming the config file and the tensor; sizes of the wrong type are refused
before transformers is asked; names transformers' model does not hold (a critic's score head on a causal
LM, an extra buffer) and configs transformers has no class for are not judged. The model's shapes are
kept on disk per config: the next check asks transformers nothing.
"""

from __future__ import annotations

import pytest

from merge_engine.errors import InvalidConfig
from merge_engine.plan import model_shapes
from merge_engine.plan.config_shapes import check_config_against_tensors, config_contradictions

CONFIG = {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "vocab_size": 1003, "hidden_size": 64,
          "intermediate_size": 96, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2}
QWEN3_NEXT = {"model_type": "qwen3_next", "architectures": ["Qwen3NextForCausalLM"], "vocab_size": 1003,
              "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
              "shared_expert_intermediate_size": 32, "num_hidden_layers": 4, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2,
              "linear_num_value_heads": 4, "linear_num_key_heads": 2, "linear_key_head_dim": 16,
              "linear_value_head_dim": 16}
DEEPSEEK_V3 = {"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"], "vocab_size": 1003,
               "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32, "num_hidden_layers": 2,
               "num_attention_heads": 4, "num_key_value_heads": 4, "n_routed_experts": 4, "num_experts_per_tok": 2,
               "n_shared_experts": 1, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1, "q_lora_rank": 32,
               "kv_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16}


def shapes(vocab=1003, hidden=64, inter=96, q=64, kv=32, layers=2, head=True):
    out = [("model.embed_tokens.weight", (vocab, hidden)), ("model.norm.weight", (hidden,))]
    if head:
        out.append(("lm_head.weight", (vocab, hidden)))
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [(p + "input_layernorm.weight", (hidden,)), (p + "self_attn.q_proj.weight", (q, hidden)),
                (p + "self_attn.q_proj.bias", (q,)), (p + "self_attn.k_proj.weight", (kv, hidden)),
                (p + "self_attn.v_proj.weight", (kv, hidden)), (p + "self_attn.o_proj.weight", (hidden, q)),
                (p + "mlp.gate_proj.weight", (inter, hidden)), (p + "mlp.down_proj.weight", (hidden, inter))]
    return out + [("score.weight", (1, hidden)), ("model.extra_persistent_buffer", (hidden,))]


def state_dict_shapes(config, hub=False):
    """(name, shape) of transformers' model of ``config``: in memory, or under the Hub's names."""
    from merge_engine.plan.transformers_conversion import fresh_meta_model, trace_reverse_conversion

    model = fresh_meta_model(config)
    memory = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if not hub:
        return list(memory.items())
    return [(name, view.shape) for name, view in trace_reverse_conversion(model, memory).items()]


def test_agreeing_configs_pass():
    assert config_contradictions(CONFIG, shapes()) == []
    assert config_contradictions(CONFIG, shapes(head=False)) == []  # tied: no lm_head
    assert config_contradictions({**CONFIG, "head_dim": 8}, shapes(q=32, kv=16)) == []
    assert config_contradictions({"model_type": "custom_remote_code"}, shapes(vocab=5)) == []  # nothing to ask


@pytest.mark.parametrize("config", [QWEN3_NEXT, DEEPSEEK_V3], ids=["qwen3_next", "deepseek_v3"])
@pytest.mark.parametrize("hub", [False, True], ids=["in_memory_names", "hub_names"])
def test_new_attention_variants_pass_under_either_naming(config, hub):
    """Qwen3-Next's q_proj holds the attention gate (2 x heads x head_dim rows): no hand rule knows it."""
    tensors = state_dict_shapes(config, hub)
    assert config_contradictions(config, tensors) == []
    if config is QWEN3_NEXT:
        assert ("model.layers.3.self_attn.q_proj.weight", (128, 64)) in tensors


def test_deepseek_multi_token_prediction_layers_after_the_decoder_pass():
    mtp = [(name.replace("model.layers.1.", "model.layers.2."), shape) for name, shape in
           state_dict_shapes(DEEPSEEK_V3) if name.startswith("model.layers.1.")]
    tensors = state_dict_shapes(DEEPSEEK_V3) + mtp
    assert config_contradictions({**DEEPSEEK_V3, "num_nextn_predict_layers": 1}, tensors) == []
    assert "model.layers.{0..2} (3)" in config_contradictions(DEEPSEEK_V3, tensors)[0]


def test_a_gated_attention_with_other_heads_is_named():
    with pytest.raises(InvalidConfig, match=r"model.layers.3.self_attn.q_proj.weight is \[128, 64\] but the "
                                            r"config implies \[256, 64\]"):
        check_config_against_tensors({**QWEN3_NEXT, "num_attention_heads": 8}, state_dict_shapes(QWEN3_NEXT, True),
                                     "run/huggingface/config.json")


@pytest.mark.parametrize("config, match", [
    ({**CONFIG, "vocab_size": 10**12}, r"model.embed_tokens.weight is \[1003, 64\] but the config implies "
                                       r"\[1000000000000, 64\]"),
    ({**CONFIG, "hidden_size": 128}, "model.embed_tokens.weight"),
    ({**CONFIG, "num_key_value_heads": 4}, "k_proj.weight is"),
    ({**CONFIG, "intermediate_size": 95}, "gate_proj.weight is"),
    ({**CONFIG, "num_hidden_layers": 5}, r"the weights hold model.layers.\{0..1\} \(2\), the config implies "
                                         r"model.layers.\{0..4\} \(5\) \(num_hidden_layers=5\)"),
    ({**CONFIG, "num_hidden_layers": 1}, r"model.layers.\{0..0\} \(1\) \(num_hidden_layers=1\)"),
    ({**CONFIG, "vocab_size": "1003"}, "vocab_size is '1003', not a positive integer"),
    ({**CONFIG, "hidden_size": -64}, "not a positive integer"),
    ({**CONFIG, "text_config": {"hidden_size": 0}}, "text_config.hidden_size is 0, not a positive integer"),
    # transformers cannot build these (a meta tensor of 10^12 x 10^12 overflows): judged by the widths alone
    ({**CONFIG, "hidden_size": 10**12}, "hidden_size is 1000000000000 but no tensor has a dimension over 1003"),
    ({**CONFIG, "hidden_size": 10**12, "num_attention_heads": 1}, "hidden_size is 1000000000000"),
    ({"model_type": "custom_remote_code", "vocab_size": 10**9}, "vocab_size is 1000000000 but no tensor"),
    ({"model_type": "custom_remote_code", "text_config": {"intermediate_size": 4096}},
     "text_config.intermediate_size is 4096"),
])
def test_contradictions_are_invalid_config_naming_the_file(config, match):
    with pytest.raises(InvalidConfig, match=match) as info:
        check_config_against_tensors(config, shapes(), "run/huggingface/config.json")
    assert info.value.path == "run/huggingface/config.json"


def test_the_model_shapes_are_kept_per_config(monkeypatch):
    config = {**CONFIG, "intermediate_size": 97}  # an entry of its own
    first = model_shapes.model_shapes(config)
    assert first["model.layers.1.mlp.up_proj.weight"] == [(97, 64)]
    ties = model_shapes.model_ties(config)
    assert ties == {} and model_shapes.model_ties({**config, "tie_word_embeddings": True}) == {
        "lm_head.weight": "model.embed_tokens.weight"}
    assert model_shapes.model_shapes({"model_type": "custom_remote_code"}) is None

    def asked(_config):
        raise AssertionError("transformers asked again")

    monkeypatch.setattr(model_shapes, "_compute", asked)  # shapes and ties are one entry
    assert model_shapes.model_shapes(config) == first and model_shapes.model_ties(config) == ties
    assert model_shapes.model_shapes({"model_type": "custom_remote_code"}) is None  # "no class" is kept too


def test_a_config_transformers_refuses_is_invalid_config_with_its_reason():
    config = {**CONFIG, "num_hidden_layers": 5, "layer_types": ["full_attention"] * 2}
    with pytest.raises(InvalidConfig, match="layer_types") as info:
        check_config_against_tensors(config, shapes(), "run/huggingface/config.json")
    assert info.value.path == "run/huggingface/config.json"
