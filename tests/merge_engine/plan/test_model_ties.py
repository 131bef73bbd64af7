"""The model's own ties decide which names may share stored bytes and which are written (issue 28).

Specification (tiny configs of the registry's classes, `synthetic_runs.tiny_configs`, built on the meta device):
- `model_ties` is transformers 5's ``all_tied_weights_keys`` of the config's class: Mamba ties ``lm_head`` to
  ``backbone.embeddings`` (a name the common embedding suffixes miss), ERNIE its decoder bias to its head's
  bias, Florence-2 three names to one shared embedding, BigBird-Pegasus's causal LM nothing although its config
  says ``tie_word_embeddings``; a config transformers has no class for has none (None: the flag's rule applies);
- `check_aliases`: a group of names on one storage passes when the model ties all of them to one of them, and
  is `AliasedTensors` naming the file when one name in it is not tied (a real sharing the model does not make);
- `plan_hf_merge` writes the name each tie keeps and none of the tied ones (as ``save_pretrained``), writes the
  head of a class that ties nothing, and refuses a tied name whose kept name is not stored;
- `check_dropped_head` compares every dropped tied copy with the kept name: a copy that differs is
  `InvalidConfig` naming both.
"""

from __future__ import annotations

import pytest
import torch

from merge_engine.errors import AliasedTensors, InvalidConfig
from merge_engine.formats.tensor_source import AliasGroup, TensorMeta
from merge_engine.plan.hf_plan import plan_hf_merge
from merge_engine.plan.model_shapes import model_shapes, model_ties
from merge_engine.plan.output_heads import check_dropped_head
from merge_engine.plan.stored_aliases import check_aliases


def _config(model_type: str) -> dict:
    from synthetic_runs.tiny_configs import registry_families, tiny_config

    family = next(f for f in registry_families() if model_type in (f.model_type, f.name))
    return tiny_config(family)


@pytest.fixture(scope="module")
def configs() -> dict[str, dict]:
    return {t: _config(t) for t in ("mamba", "ernie", "florence2", "bigbird_pegasus")}


def _metas(config: dict, names: list[str]) -> dict[str, TensorMeta]:
    shapes = model_shapes(config)
    return {n: TensorMeta(n, shapes[n][0], torch.float32) for n in names}


def test_the_ties_are_transformers_own(configs):
    assert model_ties(configs["mamba"]) == {"lm_head.weight": "backbone.embeddings.weight"}
    assert model_ties(configs["ernie"])["cls.predictions.decoder.bias"] == "cls.predictions.bias"
    florence = model_ties(configs["florence2"])
    assert set(florence.values()) == {"model.language_model.shared.weight"} and len(florence) == 3
    assert configs["bigbird_pegasus"]["tie_word_embeddings"] is True and model_ties(configs["bigbird_pegasus"]) == {}
    assert model_ties({"model_type": "not_a_transformers_type"}) is None


class _Shared:
    """A source whose names share storage as a torch.save file's do (only what check_aliases reads)."""

    def __init__(self, *groups: tuple[str, ...]):
        self._groups = [AliasGroup(g, "/ckpt/model_world_size_2_rank_0.pt", 1024) for g in groups]

    def alias_groups(self):
        return self._groups


def test_names_the_model_ties_may_share_storage(configs):
    check_aliases(_Shared(("backbone.embeddings.weight", "lm_head.weight")), configs["mamba"])
    check_aliases(_Shared(("cls.predictions.bias", "cls.predictions.decoder.bias")), configs["ernie"])
    check_aliases(_Shared(tuple(model_ties(configs["florence2"])) + ("model.language_model.shared.weight",)),
                  configs["florence2"])


def test_a_name_the_model_does_not_tie_is_still_refused(configs):
    with pytest.raises(AliasedTensors) as caught:
        check_aliases(_Shared(("backbone.embeddings.weight", "lm_head.weight", "backbone.norm_f.weight")),
                      configs["mamba"])
    assert "backbone.norm_f.weight" in caught.value.message and caught.value.path.endswith("rank_0.pt")


def test_the_plan_writes_what_save_pretrained_keeps(configs):
    mamba = _metas(configs["mamba"], ["backbone.embeddings.weight", "lm_head.weight", "backbone.norm_f.weight"])
    assert set(plan_hf_merge(mamba, configs["mamba"]).by_name()) == {"backbone.embeddings.weight",
                                                                      "backbone.norm_f.weight"}
    ernie = _metas(configs["ernie"], ["cls.predictions.bias", "cls.predictions.decoder.bias",
                                      "cls.predictions.decoder.weight", "ernie.embeddings.word_embeddings.weight"])
    assert set(plan_hf_merge(ernie, configs["ernie"]).by_name()) == {"cls.predictions.bias",
                                                                      "ernie.embeddings.word_embeddings.weight"}
    bigbird = _metas(configs["bigbird_pegasus"], ["model.decoder.embed_tokens.weight", "lm_head.weight"])
    assert "lm_head.weight" in plan_hf_merge(bigbird, configs["bigbird_pegasus"]).by_name()  # its class ties nothing
    with pytest.raises(InvalidConfig, match="backbone.embeddings.weight"):
        plan_hf_merge({"lm_head.weight": mamba["lm_head.weight"]}, configs["mamba"])


class _Values:
    """A tensor source of real values (what check_dropped_head reads)."""

    url = "/ckpt"

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors = tensors

    def metas(self):
        return {n: TensorMeta(n, tuple(t.shape), t.dtype) for n, t in self.tensors.items()}

    def iter_chunks(self, name, chunk_bytes):
        yield self.tensors[name].reshape(-1)


def test_a_dropped_tied_copy_must_equal_the_name_kept(configs):
    config = configs["ernie"]
    names = ["cls.predictions.bias", "cls.predictions.decoder.bias"]
    bias = torch.arange(float(_metas(config, names)[names[0]].shape[0]))
    plan = plan_hf_merge(_metas(config, names), config)
    check_dropped_head(_Values({names[0]: bias, names[1]: bias.clone()}), plan, 1 << 20, config)
    with pytest.raises(InvalidConfig, match="cls.predictions.decoder.bias differs from cls.predictions.bias"):
        check_dropped_head(_Values({names[0]: bias, names[1]: bias + 1}), plan, 1 << 20, config)


def _family_config(family: str, **fields) -> dict:
    """The config.json of `synthetic_runs.model_families`' tiny ``family`` (as verl saves it)."""
    from synthetic_runs.models import ModelSpec, build_config

    return {**build_config(ModelSpec(family=family, **fields)).to_dict(), "transformers_version": "5.0.0"}


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl"])
def test_a_tie_is_resolved_against_the_names_the_checkpoint_stores(family):
    """Qwen2-VL's ``lm_head.weight`` is one name in both namings, tied to ``model.language_model.embed_tokens``
    in memory (a transformers 5 trainer's checkpoint) and to ``model.embed_tokens`` on the Hub (an older 4.x
    trainer's): each checkpoint's head is tied to the embedding it stores, dropped, and checked against it."""
    config = _family_config(family, tie_word_embeddings=True)
    for embedding in ("model.language_model.embed_tokens.weight", "model.embed_tokens.weight"):
        metas = {n: TensorMeta(n, (1003, 64), torch.float32) for n in (embedding, "lm_head.weight")}
        plan = plan_hf_merge(metas, config)
        assert model_ties(config, metas)["lm_head.weight"] == embedding
        assert set(plan.by_name()) == {embedding}
        assert f"tied weights: lm_head.weight not written (it equals {embedding})" in plan.notes
        table = torch.randn(1003, 64)
        check_dropped_head(_Values({embedding: table, "lm_head.weight": table.clone()}), plan, 1 << 20, config)
        with pytest.raises(InvalidConfig, match=f"lm_head.weight differs from {embedding}"):
            check_dropped_head(_Values({embedding: table, "lm_head.weight": table + 1}), plan, 1 << 20, config)
    with pytest.raises(InvalidConfig, match="ties lm_head.weight to model.language_model.embed_tokens.weight"):
        plan_hf_merge({"lm_head.weight": metas["lm_head.weight"]}, config)  # no embedding in either naming


def test_where_the_config_class_has_no_tie_attribute_the_model_ties_decide():
    """Mllama's config class has no ``tie_word_embeddings``: a config.json without the key is planned by the
    model's own tie list (it ties nothing: the head is written), not refused."""
    config = {k: v for k, v in _config("mllama (MllamaForConditionalGeneration)").items() if k != "tie_word_embeddings"}
    config["text_config"] = {k: v for k, v in config["text_config"].items() if k != "tie_word_embeddings"}
    ties = model_ties(config)
    assert ties is not None
    head = "lm_head.weight"
    embedding = next(n for n in model_shapes(config) if n.endswith("embed_tokens.weight"))
    metas = _metas(config, [head, embedding])
    assert set(plan_hf_merge(metas, config).by_name()) == ({embedding} if head in ties else {embedding, head})
    assert set(plan_hf_merge(metas, config, tie_flag=bool(ties)).by_name()) >= {embedding}


def test_a_lora_checkpoints_tied_embedding_and_head_may_share_storage():
    """verl's LoRA of a tied model stores the embedding and the head once under PEFT's names: the model's own
    names (PEFT's prefix taken away) are what the model ties; an untied config still refuses the sharing."""
    peft_names = ("base_model.model.model.language_model.embed_tokens.weight", "base_model.model.lm_head.weight")
    check_aliases(_Shared(peft_names), _family_config("qwen2_5_vl", tie_word_embeddings=True))
    check_aliases(_Shared(("base_model.model.model.embed_tokens.weight", "base_model.model.lm_head.weight")),
                  _family_config("llama", tie_word_embeddings=True))
    with pytest.raises(AliasedTensors, match="tie_word_embeddings=false"):
        check_aliases(_Shared(peft_names), _family_config("qwen2_5_vl"))
