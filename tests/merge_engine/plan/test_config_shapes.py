"""`merge_engine.plan.config_shapes`: the shapes config.json implies, checked against the tensors (issue 9, case 13).

Specification: a config agreeing with the tensors passes (GQA heads, explicit head_dim, biases, tied
models without lm_head); each contradiction (vocab, hidden size, KV heads, intermediate size, layer
count either way) raises `InvalidConfig` naming the config file and the tensor; sizes of the wrong
type are refused; names outside the table (MoE experts, a critic's score head) are not judged.
"""

from __future__ import annotations

import pytest

from merge_engine.plan.config_shapes import check_config_against_tensors, config_contradictions
from merge_engine.errors import InvalidConfig

CONFIG = {"model_type": "qwen2", "vocab_size": 1003, "hidden_size": 64, "intermediate_size": 96,
          "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2}


def shapes(vocab=1003, hidden=64, inter=96, q=64, kv=32, layers=2, head=True):
    out = [("model.embed_tokens.weight", (vocab, hidden)), ("model.norm.weight", (hidden,))]
    if head:
        out.append(("lm_head.weight", (vocab, hidden)))
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [(p + "input_layernorm.weight", (hidden,)), (p + "self_attn.q_proj.weight", (q, hidden)),
                (p + "self_attn.q_proj.bias", (q,)), (p + "self_attn.k_proj.weight", (kv, hidden)),
                (p + "self_attn.v_proj.weight", (kv, hidden)), (p + "self_attn.o_proj.weight", (hidden, q)),
                (p + "mlp.gate_proj.weight", (inter, hidden)), (p + "mlp.down_proj.weight", (hidden, inter)),
                (p + "mlp.experts.0.gate_proj.weight", (7, hidden))]
    return out + [("score.weight", (1, hidden))]


def test_agreeing_configs_pass():
    assert config_contradictions(CONFIG, shapes()) == []
    assert config_contradictions(CONFIG, shapes(head=False)) == []  # tied: no lm_head
    assert config_contradictions({**CONFIG, "head_dim": 8}, shapes(q=32, kv=16)) == []
    assert config_contradictions({"model_type": "custom"}, shapes(vocab=5)) == []  # nothing to compare
    mla = {**CONFIG, "kv_lora_rank": 16, "v_head_dim": 16, "head_dim": 8}  # DeepSeek: o_proj is heads x v_head_dim
    assert config_contradictions(mla, shapes(q=64, kv=48)) == []
    assert config_contradictions({**CONFIG, "num_hidden_layers": 1, "num_nextn_predict_layers": 1}, shapes()) == []


@pytest.mark.parametrize("config, match", [
    ({**CONFIG, "vocab_size": 10**12}, r"model.embed_tokens.weight is \[1003, 64\] but the config implies "
                                       r"\[1000000000000, 64\]"),
    ({**CONFIG, "hidden_size": 128}, "model.embed_tokens.weight"),
    ({**CONFIG, "num_key_value_heads": 4}, "k_proj.weight is"),
    ({**CONFIG, "intermediate_size": 95}, "gate_proj.weight is"),
    ({**CONFIG, "num_hidden_layers": 5}, r"decoder layers 0..1 \(2 layers\), the config says num_hidden_layers=5"),
    ({**CONFIG, "num_hidden_layers": 1}, "num_hidden_layers=1"),
    ({**CONFIG, "vocab_size": "1003"}, "vocab_size is '1003', not a positive integer"),
    ({**CONFIG, "hidden_size": -64}, "not a positive integer"),
])
def test_contradictions_are_invalid_config_naming_the_file(config, match):
    with pytest.raises(InvalidConfig, match=match) as info:
        check_config_against_tensors(config, shapes(), "run/huggingface/config.json")
    assert info.value.path == "run/huggingface/config.json"
