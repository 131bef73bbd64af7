"""``--custom-mapping FILE.json``: extending a family table without writing code.

Specification:
- a file naming a new ``model_type`` and the family it ``extends`` makes that model mergeable;
- ``direct`` entries add 1:1 names (a new tensor gets mapped) or replace an entry with the same
  Megatron name; ``qkv`` / ``gated_mlp`` / ``vocab`` entries add special mappings;
- every mistake in the file (not JSON, unknown key, ``*`` counts differing, unknown base family,
  missing field) is an `InvalidOption` naming the file.
"""

import json

import pytest
import torch

from merge_engine.architectures import model_dims, table_for_config
from merge_engine.architectures.megatron_to_hf import plan_megatron_to_hf
from merge_engine.errors import InvalidOption, UnknownArchitecture
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
    ([1, 2], "JSON object"),
])
def test_mistakes_in_the_file_are_named(tmp_path, spec, match):
    url = _write(tmp_path, spec)
    with pytest.raises(InvalidOption, match=match) as info:
        table_for_config(CONFIG, url)
    assert info.value.path == url
