"""Multi-token-prediction layers, on tables alone (the real megatron-core MTP fixtures are in
tests/merge_engine/layouts/test_megatron_merge.py).

Specification: a canonical Megatron listing with ``mtp.layers.0.*`` is refused without a choice;
``export`` plans the Hub layout (``model.layers.L.*`` through the family table, enorm / hnorm /
eh_proj / shared_head.norm, and the embed_tokens / shared_head.head copies of the first vocab_size
rows) and counts the layers in config.json (also under transformers v5's GLM name
``num_mtp_layers``), and validation allows exactly those layers beside the model's own keys;
``drop`` plans none and says so; an MTP layer missing a tensor, or an unknown
MTP tensor, is a `MappingError` naming it.
"""

from __future__ import annotations

import pytest
import torch

from merge_engine.architectures import model_dims, table_for_config
from merge_engine.architectures.hf_to_megatron import MegatronViewOfHf
from merge_engine.architectures.megatron_to_hf import plan_megatron_to_hf
from merge_engine.architectures.mtp import hub_mtp_names
from merge_engine.errors import MappingError
from tests.merge_engine.architectures.test_tables import PADDED, DictSource, _saved_model


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    """A tiny DeepSeek-V3 (2 layers, layer 1 MoE) as canonical Megatron tensors + one MTP layer built
    like layer 1 (what megatron-core's MTP block holds)."""
    config, state = _saved_model("deepseek_v3", False, tmp_path_factory.mktemp("deepseek"))
    table = table_for_config(config)
    view = MegatronViewOfHf(DictSource(state), table, config, model_dims(config, table, padded_vocab_size=PADDED))
    megatron = {name: view.read(name) for name in view.metas()}
    for name in [n for n in megatron if n.startswith("decoder.layers.1.")]:
        megatron["mtp.layers.0.transformer_layer." + name[len("decoder.layers.1."):]] = megatron[name].clone()
    hidden = megatron["decoder.final_layernorm.weight"].shape[0]
    for name, shape in (("enorm.weight", (hidden,)), ("hnorm.weight", (hidden,)), ("eh_proj.weight", (hidden, 2 * hidden)),
                        ("final_layernorm.weight", (hidden,))):
        megatron[f"mtp.layers.0.{name}"] = torch.randn(shape)
    return config, table, megatron


def _plan(config, table, megatron, mtp):
    return plan_megatron_to_hf(DictSource(megatron), config, table=table, dims=model_dims(config, table),
                               mtp_layers=mtp)


def test_refused_without_a_choice(deepseek):
    config, table, megatron = deepseek
    with pytest.raises(MappingError, match="--mtp-layers export"):
        _plan(config, table, megatron, None)


def test_export_plans_the_hub_layout(deepseek):
    config, table, megatron = deepseek
    plan = _plan(config, table, megatron, "export")
    names = {t.name: t for t in plan.tensors}
    assert {"model.layers.2.enorm.weight", "model.layers.2.hnorm.weight", "model.layers.2.eh_proj.weight",
            "model.layers.2.shared_head.norm.weight", "model.layers.2.embed_tokens.weight",
            "model.layers.2.shared_head.head.weight", "model.layers.2.self_attn.kv_b_proj.weight",
            "model.layers.2.mlp.experts.3.down_proj.weight", "model.layers.2.mlp.gate.e_score_correction_bias"} <= set(names)
    assert names["model.layers.2.embed_tokens.weight"].shape == names["model.embed_tokens.weight"].shape
    assert plan.config_updates["num_nextn_predict_layers"] == 1
    glm_named = _plan(dict(config, num_mtp_layers=1), table, megatron, "export")
    assert glm_named.config_updates["num_mtp_layers"] == 1


def test_drop_plans_none(deepseek):
    config, table, megatron = deepseek
    plan = _plan(config, table, megatron, "drop")
    assert not any(t.name.startswith("model.layers.2.") for t in plan.tensors)
    assert plan.config_updates["num_nextn_predict_layers"] == 0 and any("MTP" in n for n in plan.notes)


@pytest.mark.parametrize("change,match", [("missing", "lacks 'mtp.layers.0.hnorm.weight'"),
                                          ("unknown", "not a tensor of an MTP layer")])
def test_damaged_mtp_layers_are_named(deepseek, change, match):
    config, table, megatron = deepseek
    damaged = dict(megatron)
    if change == "missing":
        del damaged["mtp.layers.0.hnorm.weight"]
    else:
        damaged["mtp.layers.0.extra_norm.weight"] = torch.ones(2)
    with pytest.raises(MappingError, match=match):
        _plan(config, table, damaged, "export")


def test_hub_mtp_names_are_the_layers_the_config_counts():
    """What validation allows beside the model's own keys: layers L .. L+k-1, only when the config counts them."""
    names = ["model.layers.1.mlp.gate.weight", "model.layers.2.enorm.weight", "model.layers.3.enorm.weight"]
    assert hub_mtp_names({"num_hidden_layers": 2, "num_nextn_predict_layers": 1}, names) == {"model.layers.2.enorm.weight"}
    assert hub_mtp_names({"num_hidden_layers": 2, "num_mtp_layers": 2}, names) == set(names[1:])
    assert hub_mtp_names({"num_hidden_layers": 2, "num_nextn_predict_layers": 0}, names) == set()
    assert hub_mtp_names({"num_hidden_layers": 2}, names) == set()
