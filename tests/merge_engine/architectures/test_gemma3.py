"""Gemma 3 (text) through Megatron files stepmerge writes itself — NOT a megatron-core fixture.

megatron-core 0.16.1 cannot build Gemma 3 on CPU: ``TransformerLayerSubmodules`` has no slot for
the norms after attention and after the MLP, which Megatron-Bridge's Gemma 3 spec adds with
TransformerEngine-only modules (``TERowParallelLinearLayerNorm``). So the Megatron side here is
hand-built: ``stepmerge split`` writes a torch_dist folder and legacy rank files in megatron-core's
naming as Megatron-Bridge's spec has it (``linear_qkv.layer_norm_weight``,
``linear_proj.post_layernorm.weight``, ``linear_fc1.layer_norm_weight``,
``linear_fc2.post_layernorm.weight``, tied: no ``output_layer``). Specification:
- the torch_dist keys are those names (layers stacked on dim 0);
- Hub model -> Megatron (dist, TP 2 legacy) -> merge gives the Hub model back bit for bit, with the
  names ``save_pretrained`` writes, and transformers' logits of the result equal the original's.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from merge_engine.commands.merge import merge_checkpoint
from merge_engine.commands.split import split_hf_to_megatron
from merge_engine.formats.dcp_index import read_index
from merge_engine.output.jobs import OutputOptions
from tests.merge_engine.layouts.test_megatron_merge import _tensors

CONFIG = dict(vocab_size=100, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, max_position_embeddings=64, sliding_window=16,
              query_pre_attn_scalar=8, tie_word_embeddings=True)


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    """A tiny random Gemma 3 text model as save_pretrained writes it, with its logits on a prompt."""
    folder = tmp_path_factory.mktemp("gemma3") / "hub"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("gemma3_text", **CONFIG))
    for parameter in model.parameters():  # norms away from zero, so a swapped norm changes the logits
        parameter.data.normal_(0, 0.2)
    model.save_pretrained(folder)
    ids = torch.arange(12).reshape(1, 12)
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    return str(folder), ids, logits


@pytest.mark.parametrize("options", [OutputOptions(format="dist"), OutputOptions(tp=2, pp=2)], ids=["dist", "tp2_pp2_legacy"])
def test_split_and_merge_back_is_exact(gemma3, tmp_path, options):
    hub, ids, logits = gemma3
    split_hf_to_megatron(hub, str(tmp_path / "megatron"), options)
    if options.format == "dist":
        keys = set(read_index(str(tmp_path / "megatron" / "dist_ckpt")).tensors)
        assert {"decoder.layers.self_attention.linear_qkv.layer_norm_weight",
                "decoder.layers.self_attention.linear_proj.post_layernorm.weight",
                "decoder.layers.mlp.linear_fc1.layer_norm_weight",
                "decoder.layers.mlp.linear_fc2.post_layernorm.weight"} <= keys
        assert "output_layer.weight" not in keys
    merge_checkpoint(str(tmp_path / "megatron"), str(tmp_path / "merged"), OutputOptions(backend="megatron"))
    original, ours = _tensors(hub), _tensors(str(tmp_path / "merged"))
    assert set(ours) == set(original)
    assert all(torch.equal(ours[k], v) for k, v in original.items())
    model, info = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"), dtype=torch.float32,
                                                       output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, logits)
