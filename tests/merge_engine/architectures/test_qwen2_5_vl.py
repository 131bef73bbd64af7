"""Qwen2.5-VL (vision tower + merger + language model) through Megatron files stepmerge writes itself
— NOT a megatron-core fixture.

megatron-core 0.16.1 cannot build Qwen2.5-VL on CPU (``LLaVAModel``: ``ValueError: Vision model
qwen2_5_vl is not supported.``), so the Megatron side is written by ``stepmerge split --format dist``
in Megatron-Bridge's naming (``qwen25_vl_bridge.py``): the language model under ``language_model.``
(``language_model.decoder.layers.self_attention.linear_qkv.weight``, layers stacked on dim 0), the
vision tower and merger under their Hugging Face names (``visual.blocks.0.attn.qkv.weight``,
``visual.merger.mlp.0.weight``). Not proven here: that a real Megatron-Bridge run writes exactly
these keys (no writer on this machine). Specification:
- Hub model -> Megatron (dist) -> merge gives every tensor back bit for bit, with exactly the names
  ``save_pretrained`` writes, and the model loads with no missing or unexpected key and gives the
  original's logits on a text input;
- the processor / tokenizer files travel with it: the split's ``huggingface/`` folder and the merged
  output hold them byte for byte;
- the legacy per-rank format (which Megatron-Bridge does not write) is refused with `InvalidOption`.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, Qwen2_5_VLForConditionalGeneration

from merge_engine.errors import InvalidOption
from merge_engine.commands.merge import merge_checkpoint
from merge_engine.commands.split import split_hf_to_megatron
from merge_engine.formats.dcp_index import read_index
from merge_engine.output.jobs import OutputOptions
from tests.merge_engine.layouts.test_megatron_merge import _tensors

TEXT = dict(vocab_size=100, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64,
            rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]})
VISION = dict(depth=3, hidden_size=16, intermediate_size=24, num_heads=2, out_hidden_size=32, patch_size=2,
              temporal_patch_size=1, spatial_merge_size=2, fullatt_block_indexes=[1], window_size=8)
# the processor files of a Qwen2.5-VL Hub repository (fields as Qwen/Qwen2.5-VL-3B-Instruct has them; the
# image processor itself needs PIL and torchvision, not installed here, so the files are written as text)
PROCESSOR_FILES = {
    "preprocessor_config.json": {"min_pixels": 3136, "max_pixels": 12845056, "patch_size": 2,
                                 "temporal_patch_size": 1, "merge_size": 2,
                                 "image_mean": [0.48145466, 0.4578275, 0.40821073],
                                 "image_std": [0.26862954, 0.26130258, 0.27577711],
                                 "image_processor_type": "Qwen2VLImageProcessor",
                                 "processor_class": "Qwen2_5_VLProcessor"},
    "chat_template.json": {"chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}"},
    "tokenizer_config.json": {"model_max_length": 64, "processor_class": "Qwen2_5_VLProcessor",
                              "tokenizer_class": "Qwen2Tokenizer"},
}


@pytest.fixture(scope="module")
def qwen2_5_vl(tmp_path_factory):
    """A tiny random Qwen2.5-VL as save_pretrained writes it, its processor files, its logits on a text prompt."""
    folder = tmp_path_factory.mktemp("qwen2_5_vl") / "hub"
    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration(AutoConfig.for_model("qwen2_5_vl", text_config=TEXT,
                                                                    vision_config=VISION))
    for parameter in model.parameters():  # norms away from one, so a swapped tensor changes the logits
        parameter.data.normal_(0, 0.2)
    model.save_pretrained(folder)
    for name, content in PROCESSOR_FILES.items():
        (folder / name).write_text(json.dumps(content, indent=2))
    ids = torch.arange(3, 15).reshape(1, 12)
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    return str(folder), ids, logits


def test_split_in_megatron_bridge_names_and_merge_back_is_exact(qwen2_5_vl, tmp_path):
    hub, ids, logits = qwen2_5_vl
    megatron = tmp_path / "megatron"
    split_hf_to_megatron(hub, str(megatron), OutputOptions(format="dist"))
    keys = set(read_index(str(megatron / "dist_ckpt")).tensors)
    assert {"language_model.embedding.word_embeddings.weight", "language_model.output_layer.weight",
            "language_model.decoder.final_layernorm.weight",
            "language_model.decoder.layers.self_attention.linear_qkv.weight",
            "language_model.decoder.layers.self_attention.linear_qkv.bias",
            "language_model.decoder.layers.self_attention.linear_qkv.layer_norm_weight",
            "language_model.decoder.layers.mlp.linear_fc1.weight",
            "visual.patch_embed.proj.weight", "visual.blocks.2.attn.qkv.weight", "visual.blocks.0.mlp.gate_proj.bias",
            "visual.merger.ln_q.weight", "visual.merger.mlp.0.weight", "visual.merger.mlp.2.bias"} <= keys
    assert not [k for k in keys if k.startswith(("decoder.", "embedding.", "output_layer."))]
    assert not [k for k in keys if k.startswith("visual.blocks.3.")]  # vision_config.depth blocks, no more
    built_with = json.loads((megatron / "transformer_config.json").read_text())  # the language model's values
    assert (built_with["num_layers"], built_with["ffn_hidden_size"], built_with["max_sequence_length"]) == (2, 48, 64)
    assert (built_with["position_embedding_type"], built_with["mrope_section"]) == ("mrope", [1, 1, 2])
    assert built_with["rotary_base"] == 1e6 and built_with["add_qkv_bias"]

    merged = tmp_path / "merged"
    merge_checkpoint(str(megatron), str(merged), OutputOptions(backend="megatron"))
    original, ours = _tensors(hub), _tensors(str(merged))
    assert set(ours) == set(original)  # exactly the names save_pretrained writes
    assert all(ours[k].dtype == v.dtype and torch.equal(ours[k], v) for k, v in original.items())
    for name in PROCESSOR_FILES:
        source = (Path(hub) / name).read_bytes()
        assert (megatron / "huggingface" / name).read_bytes() == source
        assert (merged / name).read_bytes() == source
    model, info = Qwen2_5_VLForConditionalGeneration.from_pretrained(str(merged), dtype=torch.float32,
                                                                      output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, logits)


def test_legacy_format_is_refused(qwen2_5_vl, tmp_path):
    with pytest.raises(InvalidOption, match="language_model"):
        split_hf_to_megatron(qwen2_5_vl[0], str(tmp_path / "megatron"), OutputOptions(tp=2))
    assert not (tmp_path / "megatron").exists()
