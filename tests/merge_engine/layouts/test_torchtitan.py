"""torchtitan checkpoints (`merge_engine.layouts.torchtitan`): a ``step-N/`` DCP save whose model state is flattened
at the top in torchtitan's own names, optimizer state nested, saved by torch's ``dcp.save`` itself. The weights are
a transformers model's, taken to torchtitan's names and RoPE row order by the ``from_hf`` of torchtitan 0.3.0's
adapters (its ``from_hf_map`` and ``_reverse_permute``, written out here as in torchtitan).

- Llama (rows of q/k in torchtitan's complex-RoPE order) and Qwen3 (names only) merge bit for bit into the model's
  Hub weights; transformers gives the model's logits exactly;
- the config comes from ``--hf_model_path`` (torchtitan saves none); a family without a table (Mistral) is a one-line
  `UnsupportedLayout` naming the layout, nothing written.
"""

from __future__ import annotations

import re

import pytest
import torch
from safetensors.torch import load_file

from merge_engine.cli import main as stepmerge
from merge_engine.layouts import check_checkpoint
from tests.release_checks import assert_model_logits, load_model

# torchtitan 0.3.0's from_hf_map (llama3; qwen3 adds q_norm / k_norm), Hub name -> torchtitan name
FROM_HF = {
    "model.embed_tokens.weight": "tok_embeddings.weight",
    "model.layers.{}.self_attn.q_proj.weight": "layers.{}.attention.qkv_linear.wq.weight",
    "model.layers.{}.self_attn.k_proj.weight": "layers.{}.attention.qkv_linear.wk.weight",
    "model.layers.{}.self_attn.v_proj.weight": "layers.{}.attention.qkv_linear.wv.weight",
    "model.layers.{}.self_attn.o_proj.weight": "layers.{}.attention.wo.weight",
    "model.layers.{}.self_attn.q_norm.weight": "layers.{}.attention.q_norm.weight",
    "model.layers.{}.self_attn.k_norm.weight": "layers.{}.attention.k_norm.weight",
    "model.layers.{}.mlp.gate_proj.weight": "layers.{}.feed_forward.w1.weight",
    "model.layers.{}.mlp.up_proj.weight": "layers.{}.feed_forward.w3.weight",
    "model.layers.{}.mlp.down_proj.weight": "layers.{}.feed_forward.w2.weight",
    "model.layers.{}.input_layernorm.weight": "layers.{}.attention_norm.weight",
    "model.layers.{}.post_attention_layernorm.weight": "layers.{}.ffn_norm.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "lm_head.weight",
}


def _reverse_permute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """torchtitan's Llama3StateDictAdapter._reverse_permute (Hub rotate-half rows -> its complex-RoPE rows)."""
    dim1, dim2 = w.shape
    return w.view(n_heads, 2, dim1 // n_heads // 2, dim2).transpose(1, 2).reshape(dim1, dim2)


def _from_hf(state: dict[str, torch.Tensor], config, permute: bool) -> dict[str, torch.Tensor]:
    out = {}
    for key, value in state.items():
        abstract = re.sub(r"\.(\d+)\.", ".{}.", key, count=1)
        layer = re.search(r"\.(\d+)\.", key)
        if permute and abstract.endswith("q_proj.weight"):
            value = _reverse_permute(value, config.num_attention_heads)
        if permute and abstract.endswith("k_proj.weight"):
            value = _reverse_permute(value, config.num_key_value_heads)
        out[FROM_HF[abstract].format(layer.group(1) if layer else "")] = value.clone()
    return out


def _model(family: str):
    from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen3Config

    common = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, tie_word_embeddings=False)
    config = {"llama": LlamaConfig, "qwen3": Qwen3Config, "mistral": MistralConfig}[family](**common)
    torch.manual_seed(7)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_()
    return model.eval()


def _torchtitan_step(tmp_path, family: str):
    """(step folder, the model's save_pretrained folder): the model saved as torchtitan saves a step."""
    import torch.distributed.checkpoint as dcp

    model = _model(family)
    hf_dir = tmp_path / "hf"
    model.save_pretrained(hf_dir)
    titan = _from_hf(model.state_dict(), model.config, permute=family == "llama")
    step = tmp_path / "run" / "step-20"
    dcp.save({**titan, "optimizer": {"state": {"norm.weight": {"exp_avg": torch.zeros(32)}}},
              "train_state": {"step": torch.tensor(20)}}, checkpoint_id=str(step))
    return step, hf_dir, model


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_a_torchtitan_step_merges_into_the_hub_weights(tmp_path, family):
    step, hf_dir, model = _torchtitan_step(tmp_path, family)
    assert check_checkpoint(str(step)).layout == "torchtitan"
    out = tmp_path / "out"
    assert stepmerge(["merge", "--local_dir", str(step), "--target_dir", str(out)]) != 0 and not out.exists()
    assert stepmerge(["merge", "--local_dir", str(step), "--hf_model_path", str(hf_dir), "--target_dir", str(out)]) == 0
    merged = {}
    for path in out.glob("*.safetensors"):
        merged.update(load_file(str(path)))
    reference = model.state_dict()
    assert sorted(merged) == sorted(reference)
    for name, tensor in reference.items():
        assert torch.equal(merged[name], tensor), name
    assert_model_logits(str(out), load_model(str(hf_dir)))


def test_a_family_without_a_table_is_a_named_refusal(tmp_path, capsys):
    step, hf_dir, _ = _torchtitan_step(tmp_path, "mistral")  # Llama's names, a model_type torchtitan has no adapter for
    out = tmp_path / "out"
    assert stepmerge(["merge", "--local_dir", str(step), "--hf_model_path", str(hf_dir), "--target_dir", str(out)]) != 0
    assert "UnsupportedLayout: torchtitan: no name table for model_type 'mistral'" in capsys.readouterr().err
    assert not out.exists()
