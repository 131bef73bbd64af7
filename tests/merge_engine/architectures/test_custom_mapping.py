"""``--custom-mapping FILE.json``: extending a family table without writing code.

Specification:
- a file naming a new ``model_type`` and the family it ``extends`` makes that model mergeable;
- ``direct`` entries add 1:1 names (a new tensor gets mapped) or replace an entry with the same
  Megatron name; ``qkv`` / ``gated_mlp`` / ``vocab`` entries add special mappings;
- ``moe_layer_rule`` / ``dense_layers`` say which layers of a MoE model are dense, so a mixed
  dense / MoE model of a family the tables do not know maps (the dense layer through the dense MLP
  entries, the others through the expert entries), and a layer that contradicts it is refused;
- every mistake in the file (not JSON, unknown key, ``*`` counts differing, unknown base family,
  missing field) is an `InvalidOption` naming the file.
"""

import json

import pytest
import torch

from merge_engine.architectures import model_dims, table_for_config
from merge_engine.architectures.megatron_to_hf import plan_megatron_to_hf
from merge_engine.errors import InvalidOption, MappingError, UnknownArchitecture
from tests.merge_engine.architectures.test_tables import DictSource

CONFIG = dict(model_type="my_llama", architectures=["MyLlamaForCausalLM"], vocab_size=10, hidden_size=4,
              num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=1, tie_word_embeddings=True)


def _megatron() -> dict[str, torch.Tensor]:
    return {
        "embedding.word_embeddings.weight": torch.randn(16, 4),
        "decoder.layers.0.input_layernorm.weight": torch.randn(4),
        "decoder.layers.0.self_attention.linear_qkv.weight": torch.randn(8, 4),
        "decoder.layers.0.self_attention.linear_proj.weight": torch.randn(4, 4),
        "decoder.layers.0.pre_mlp_layernorm.weight": torch.randn(4),
        "decoder.layers.0.mlp.linear_fc1.weight": torch.randn(12, 4),
        "decoder.layers.0.mlp.linear_fc2.weight": torch.randn(4, 6),
        "decoder.final_layernorm.weight": torch.randn(4),
    }


def _write(tmp_path, spec) -> str:
    path = tmp_path / "mapping.json"
    path.write_text(json.dumps(spec) if not isinstance(spec, str) else spec)
    return str(path)


def _plan(megatron, url):
    table = table_for_config(CONFIG, url)
    return plan_megatron_to_hf(DictSource(megatron), CONFIG, table=table, dims=model_dims(CONFIG, table))


def test_new_model_type_needs_a_table_or_a_mapping(tmp_path):
    with pytest.raises(UnknownArchitecture, match="my_llama"):
        table_for_config(CONFIG)
    table = table_for_config(CONFIG, _write(tmp_path, {"extends": "llama", "model_types": ["my_llama"]}))
    assert table.name == "llama" and "my_llama" in table.model_types


def test_direct_entries_add_and_replace(tmp_path):
    """A new tensor is mapped 1:1; an existing Megatron name gets a new Hugging Face name."""
    url = _write(tmp_path, {"extends": "llama", "model_types": ["my_llama"], "direct": {
        "decoder.layers.*.self_attention.gain.weight": "model.layers.*.self_attn.gain.weight",
        "decoder.final_layernorm.weight": "model.final_norm.weight"}})
    megatron = _megatron()
    megatron["decoder.layers.0.self_attention.gain.weight"] = torch.randn(4)
    names = {t.name: t for t in _plan(megatron, url).tensors}
    assert "model.layers.0.self_attn.gain.weight" in names
    assert "model.final_norm.weight" in names and "model.norm.weight" not in names


def test_special_entries(tmp_path):
    """A second fused projection (qkv of a cross-attention) split by query group like the first."""
    url = _write(tmp_path, {"extends": "llama", "model_types": ["my_llama"], "qkv": [{
        "megatron": "decoder.layers.*.cross_attention.linear_qkv.weight", "q": "model.layers.*.cross.q.weight",
        "k": "model.layers.*.cross.k.weight", "v": "model.layers.*.cross.v.weight"}]})
    megatron = _megatron()
    megatron["decoder.layers.0.cross_attention.linear_qkv.weight"] = torch.randn(8, 4)
    shapes = {t.name: t.shape for t in _plan(megatron, url).tensors}
    assert shapes["model.layers.0.cross.q.weight"] == (4, 4) and shapes["model.layers.0.cross.v.weight"] == (2, 4)


@pytest.mark.parametrize("spec,match", [
    ("{not json", "not valid JSON"),
    ({"extends": "llama", "renames": {}}, "unknown keys"),
    ({"extends": "llama", "direct": {"decoder.layers.*.x.weight": "model.x.weight"}}, "same number of"),
    ({"extends": "gpt5"}, "extends 'gpt5'"),
    ({"extends": "llama", "qkv": [{"megatron": "a.*"}]}, "lacks a field"),
    ({"extends": "qwen3_moe", "moe_layer_rule": "every_other"}, "moe_layer_rule 'every_other'"),
    ({"extends": "qwen3_moe", "dense_layers": [0, "one"]}, "dense_layers must be a list"),
    ([1, 2], "JSON object"),
])
def test_mistakes_in_the_file_are_named(tmp_path, spec, match):
    url = _write(tmp_path, spec)
    with pytest.raises(InvalidOption, match=match) as info:
        table_for_config(CONFIG, url)
    assert info.value.path == url


MOE_CONFIG = dict(model_type="my_moe", architectures=["MyMoeForCausalLM"], vocab_size=10, hidden_size=4,
                  num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=2, tie_word_embeddings=True,
                  num_experts=2)


def _mixed_megatron() -> dict[str, torch.Tensor]:
    """Layer 0 dense, layer 1 with a router and two experts (what megatron-core's reader gives)."""
    out = {k: v for k, v in _megatron().items()}
    for name in ("input_layernorm.weight", "self_attention.linear_qkv.weight", "self_attention.linear_proj.weight",
                 "pre_mlp_layernorm.weight"):
        out[f"decoder.layers.1.{name}"] = out[f"decoder.layers.0.{name}"].clone()
    for layer in (0, 1):  # Qwen3-MoE attention: per-head q / k norms
        out[f"decoder.layers.{layer}.self_attention.q_layernorm.weight"] = torch.randn(2)
        out[f"decoder.layers.{layer}.self_attention.k_layernorm.weight"] = torch.randn(2)
    out["decoder.layers.1.mlp.router.weight"] = torch.randn(2, 4)
    for e in range(2):
        out[f"decoder.layers.1.mlp.experts.local_experts.{e}.linear_fc1.weight"] = torch.randn(8, 4)
        out[f"decoder.layers.1.mlp.experts.local_experts.{e}.linear_fc2.weight"] = torch.randn(4, 4)
    return out


def test_mixed_dense_and_moe_layers_of_an_unknown_family(tmp_path):
    """A MoE family the tables do not know, whose first layer is dense: the custom mapping names
    the dense layer; its MLP maps to mlp.gate_proj/up_proj/down_proj, layer 1's to per-expert
    names; without ``dense_layers`` the same tensors are refused (layer 0 has no experts)."""
    megatron = _mixed_megatron()
    url = _write(tmp_path, {"extends": "qwen3_moe", "model_types": ["my_moe"], "moe_layer_rule": "all",
                            "dense_layers": [0], "direct": {}})
    table = table_for_config(MOE_CONFIG, url)
    dims = model_dims(MOE_CONFIG, table)
    assert dims.moe_layers == frozenset({1}) and dims.mixed_layers
    names = {t.name for t in plan_megatron_to_hf(DictSource(megatron), MOE_CONFIG, table=table, dims=dims).tensors}
    assert {"model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.down_proj.weight",
            "model.layers.1.mlp.gate.weight", "model.layers.1.mlp.experts.1.up_proj.weight"} <= names
    assert not any(n.startswith("model.layers.0.mlp.experts") for n in names)
    every_layer = table_for_config(MOE_CONFIG, _write(tmp_path, {"extends": "qwen3_moe", "model_types": ["my_moe"],
                                                                 "moe_layer_rule": "all"}))
    with pytest.raises(MappingError, match=r"model\.layers\.0\.mlp"):
        plan_megatron_to_hf(DictSource(megatron), MOE_CONFIG, table=every_layer, dims=model_dims(MOE_CONFIG, every_layer))
