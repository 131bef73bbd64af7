"""The family tables against real transformers models, one class per family.

Specification, for each family (tiny sizes, GQA, tied and untied):
- the Hugging Face names the table expects for a config are exactly the names transformers itself
  saves for that config (``save_pretrained``: hub naming, e.g. Mixtral's ``block_sparse_moe``);
- Hugging Face -> canonical Megatron (the split's view) -> Hugging Face (the merge's plan) gives
  back every tensor bit for bit, and the Megatron side has the shapes Megatron uses (fused QKV,
  [gate; up] fc1, padded vocabulary);
- the table is strict both ways: an extra tensor, a missing tensor, or a tensor whose config switch
  is off is a `MappingError` naming it; an unknown model type lists the supported families.
"""

from __future__ import annotations

import math

import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

from merge_engine.architectures import FAMILY_MODULES, family_tables, model_dims, table_for_config
from merge_engine.architectures.binding import expected_bindings
from merge_engine.architectures.hf_to_megatron import MegatronViewOfHf
from merge_engine.architectures.mappings import DirectMapping
from merge_engine.architectures.megatron_to_hf import plan_megatron_to_hf
from merge_engine.errors import MappingError, UnknownArchitecture
from merge_engine.formats.tensor_source import TensorMeta
from merge_engine.output.shard_job import tensor_chunks

VOCAB, PADDED = 100, 128
COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64)
MOE = dict(num_experts_per_tok=2, moe_intermediate_size=24, decoder_sparse_step=1, mlp_only_layers=[])
CONFIGS = {
    "llama": dict(COMMON),
    "mistral": dict(COMMON),
    "qwen2": dict(COMMON),
    "qwen3": dict(COMMON, head_dim=16),
    "mixtral": dict(COMMON, num_local_experts=4, num_experts_per_tok=2, intermediate_size=24),
    "qwen2_moe": dict(COMMON, num_experts=4, shared_expert_intermediate_size=32, **MOE),
    "qwen3_moe": dict(COMMON, num_experts=4, head_dim=16, **dict(MOE, mlp_only_layers=[0])),  # layer 0 dense
    # MLA + sigmoid router with its bias + shared experts; layer 0 dense (first_k_dense_replace)
    "deepseek_v3": dict(COMMON, num_key_value_heads=4, n_routed_experts=4, n_shared_experts=1, moe_intermediate_size=24,
                        num_experts_per_tok=2, first_k_dense_replace=1, n_group=1, topk_group=1, q_lora_rank=16,
                        kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8),
    # GLM-4.5: q/k/v bias, no q/k norms (use_qk_norm off), DeepSeek-style MoE, layer 0 dense
    "glm4_moe": dict(COMMON, n_routed_experts=4, n_shared_experts=1, moe_intermediate_size=24, num_experts_per_tok=2,
                     first_k_dense_replace=1, attention_bias=True, use_qk_norm=False, head_dim=8),
    # Gemma 3 text: sandwich norms, q/k norms, tied; no megatron-core writer (see gemma3.py / the note)
    "gemma3": dict(COMMON, head_dim=8, sliding_window=16, query_pre_attn_scalar=8),
    # Qwen2.5-VL: Qwen2 language model + vision tower (3 blocks: not the 2 text layers) + merger;
    # Megatron-Bridge naming, no megatron-core writer (see qwen2_5_vl.py / test_qwen2_5_vl.py)
    "qwen2_5_vl": dict(text_config=dict(COMMON, rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]}),
                       vision_config=dict(depth=3, hidden_size=16, intermediate_size=24, num_heads=2,
                                          out_hidden_size=32, patch_size=2, temporal_patch_size=1,
                                          spatial_merge_size=2, fullatt_block_indexes=[1], window_size=8)),
}
MODEL_TYPES = {"gemma3": "gemma3_text"}  # family table -> the model_type its tiny config gets, when they differ
MODEL_CLASSES = {"qwen2_5_vl": AutoModelForImageTextToText}  # not a causal LM class in transformers


class DictSource:
    """A TensorSource over an in-memory dict (what a layout would give)."""

    url = "memory://"

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def metas(self):
        return {n: TensorMeta(n, tuple(t.shape), t.dtype) for n, t in self.tensors.items()}

    def read(self, name):
        return self.tensors[name]

    def iter_chunks(self, name, max_bytes=1 << 20):
        flat = self.tensors[name].reshape(-1)
        step = max(1, max_bytes // flat.element_size())
        for i in range(0, flat.numel(), step):
            yield flat[i:i + step]

    def close(self):
        pass


def _saved_model(family: str, tied: bool, tmp_path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config dict, state) as transformers saves a tiny random model of ``family`` (a family not in `CONFIGS` is
    Llama-shaped: the common sizes)."""
    config = AutoConfig.for_model(MODEL_TYPES.get(family, family), tie_word_embeddings=tied,
                                  **CONFIGS.get(family, COMMON))
    torch.manual_seed(0)
    model = MODEL_CLASSES.get(family, AutoModelForCausalLM).from_config(config)
    model.save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        state = {k: f.get_tensor(k) for k in f.keys()}
    return config.to_dict(), state


def _merge(source, config: dict) -> dict[str, torch.Tensor]:
    table = table_for_config(config)
    plan = plan_megatron_to_hf(source, config, table=table, dims=model_dims(config, table))
    return {t.name: torch.cat(list(tensor_chunks(t, source, 1 << 12))).reshape(t.shape) for t in plan.tensors}


def test_every_family_module_is_registered():
    assert list(family_tables()) == list(FAMILY_MODULES)


@pytest.mark.parametrize("family", FAMILY_MODULES)
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
class TestFamily:
    def test_expected_names_are_what_transformers_saves(self, family, tied, tmp_path):
        config, state = _saved_model(family, tied, tmp_path)
        table = table_for_config(config)
        assert table.name == family
        dims = model_dims(config, table)
        expected = {name for b in expected_bindings(table, config, dims) for name in b.hf}
        assert expected == set(state) - ({"lm_head.weight"} if tied else set())

    def test_hf_to_megatron_to_hf_is_exact(self, family, tied, tmp_path):
        config, state = _saved_model(family, tied, tmp_path)
        table = table_for_config(config)
        dims = model_dims(config, table, padded_vocab_size=PADDED)
        view = MegatronViewOfHf(DictSource(state), table, config, dims)
        megatron = {name: view.read(name) for name in view.metas()}
        heads, kv, d = dims.num_heads, dims.num_kv_heads, dims.head_dim
        assert megatron["embedding.word_embeddings.weight"].shape == (PADDED, 32)
        if "decoder.layers.1.self_attention.linear_kv_down_proj.weight" not in megatron:  # MLA is a renaming
            assert megatron["decoder.layers.1.self_attention.linear_qkv.weight"].shape == ((heads + 2 * kv) * d, 32)
        assert ("output_layer.weight" in megatron) is not tied
        fc1 = [n for n in megatron if n.endswith("linear_fc1.weight")]
        assert fc1 and all(megatron[n].shape[0] == 2 * megatron[n.replace("fc1", "fc2")].shape[1] for n in fc1)
        back = _merge(DictSource(megatron), config)
        expected = {k: v for k, v in state.items() if not (tied and k == "lm_head.weight")}
        assert set(back) == set(expected)
        assert all(torch.equal(back[k], expected[k]) for k in expected)


class TestStrictness:
    CONFIG = AutoConfig.for_model("qwen2", **COMMON).to_dict()

    def _megatron(self, tmp_path):
        config, state = _saved_model("qwen2", False, tmp_path)
        table = table_for_config(config)
        view = MegatronViewOfHf(DictSource(state), table, config, model_dims(config, table, padded_vocab_size=PADDED))
        return config, {name: view.read(name) for name in view.metas()}

    def test_unmapped_megatron_tensor_is_named(self, tmp_path):
        config, megatron = self._megatron(tmp_path)
        megatron["decoder.layers.0.self_attention.rotary_scale.weight"] = torch.ones(2)
        with pytest.raises(MappingError, match="rotary_scale"):
            _merge(DictSource(megatron), config)

    def test_missing_megatron_tensor_names_the_output(self, tmp_path):
        config, megatron = self._megatron(tmp_path)
        del megatron["decoder.layers.1.mlp.linear_fc2.weight"]
        with pytest.raises(MappingError, match=r"model\.layers\.1\.mlp\.down_proj\.weight"):
            _merge(DictSource(megatron), config)

    def test_layer_beyond_the_config_is_refused(self, tmp_path):
        config, megatron = self._megatron(tmp_path)
        megatron["decoder.layers.2.input_layernorm.weight"] = torch.ones(32)
        with pytest.raises(MappingError, match="beyond what config.json describes"):
            _merge(DictSource(megatron), config)

    def test_bias_with_the_config_switch_off_is_refused(self, tmp_path):
        config, state = _saved_model("llama", False, tmp_path)
        layers = [n for n in state if n.endswith("q_proj.weight")]
        for name in layers:
            for p in ("q", "k", "v"):
                weight = state[name.replace("q_proj", f"{p}_proj")]
                state[name.replace("q_proj", f"{p}_proj").replace("weight", "bias")] = torch.zeros(weight.shape[0])
        table = table_for_config(config)
        with pytest.raises(MappingError, match="attention_bias off"):
            MegatronViewOfHf(DictSource(state), table, config, model_dims(config, table, padded_vocab_size=PADDED))

    def test_hf_fused_input_missing_a_part(self, tmp_path):
        config, state = _saved_model("qwen2", False, tmp_path)
        del state["model.layers.0.self_attn.k_proj.weight"]
        table = table_for_config(config)
        with pytest.raises(MappingError, match=r"k_proj\.weight' is missing"):
            MegatronViewOfHf(DictSource(state), table, config, model_dims(config, table, padded_vocab_size=PADDED))

    def test_table_mapping_a_tensor_twice(self, tmp_path):
        """Two entries claiming the same Megatron tensor are caught when they meet a checkpoint."""
        config, megatron = self._megatron(tmp_path)
        table = table_for_config(config)
        doubled = table.extended(special=(*table.special, DirectMapping("decoder.layers.*.input_layernorm.weight",
                                                                        hf_name="model.layers.*.extra_norm.weight")))
        with pytest.raises(MappingError, match="claimed by two entries"):
            plan_megatron_to_hf(DictSource(megatron), config, table=doubled, dims=model_dims(config, doubled))

    def test_table_producing_a_name_twice(self, tmp_path):
        config, megatron = self._megatron(tmp_path)
        table = table_for_config(config)
        clash = dict(table.direct)
        clash["decoder.layers.*.pre_mlp_layernorm.weight"] = "model.layers.*.input_layernorm.weight"
        with pytest.raises(MappingError, match="produced twice"):
            plan_megatron_to_hf(DictSource(megatron), config, table=table.extended(direct=clash),
                                dims=model_dims(config, table))

    def test_unknown_architecture_lists_families_and_how_to_add(self):
        with pytest.raises(UnknownArchitecture) as info:
            table_for_config({"model_type": "falcon", "architectures": ["FalconForCausalLM"]})
        message = str(info.value)
        assert all(family in message for family in FAMILY_MODULES)
        assert "--custom-mapping" in message and "architectures/families/<family>.py" in message


def test_padding_rows_are_never_read(tmp_path):
    """The merge streams the embedding's first vocab_size rows and stops: padding stays unread."""
    config, state = _saved_model("llama", False, tmp_path)
    table = table_for_config(config)
    view = MegatronViewOfHf(DictSource(state), table, config, model_dims(config, table, padded_vocab_size=PADDED))
    megatron = {name: view.read(name) for name in view.metas()}
    megatron["embedding.word_embeddings.weight"][VOCAB:] = float("nan")  # poison the padding
    source = DictSource(megatron)
    read = []
    original = source.iter_chunks

    def counting(name, max_bytes=1 << 20):
        for chunk in original(name, 32 * 4 * 10):  # ten rows per chunk
            read.append((name, chunk.numel()))
            yield chunk

    source.iter_chunks = counting
    merged = _merge(source, config)
    assert torch.equal(merged["model.embed_tokens.weight"], state["model.embed_tokens.weight"])
    embed_elems = sum(n for name, n in read if name == "embedding.word_embeddings.weight")
    assert embed_elems == VOCAB * 32 and math.isfinite(merged["model.embed_tokens.weight"].sum())


def test_critic_value_head_becomes_score(tmp_path):
    """verl's Megatron critic has a one-row output_layer: it is written as score.weight of a
    token-classification model, even when the base config ties its embeddings."""
    config, state = _saved_model("qwen2", True, tmp_path)
    table = table_for_config(config)
    view = MegatronViewOfHf(DictSource(state), table, config, model_dims(config, table, padded_vocab_size=PADDED))
    megatron = {name: view.read(name) for name in view.metas()}
    megatron["output_layer.weight"] = torch.randn(1, 32)
    plan = plan_megatron_to_hf(DictSource(megatron), config, table=table, dims=model_dims(config, table))
    names = {t.name for t in plan.tensors}
    assert "score.weight" in names and "lm_head.weight" not in names
    assert plan.config_updates["architectures"] == ["Qwen2ForTokenClassification"]
    assert plan.config_updates["tie_word_embeddings"] is False
