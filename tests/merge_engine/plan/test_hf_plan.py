"""The Hugging Face-names planner (`merge_engine.plan.hf_plan`) and the plan record's options
(`merge_engine.plan.merge_plan`): every output tensor and its file decided from metadata alone.

Specification: --dtype casts floating-point tensors only; tied lm_head is dropped only when the
config ties it; a verl --tie-word-embedding flag may only confirm the config; a critic gets a
token-classification architecture; sizes parse like save_pretrained's.
"""

import pytest
import torch

from merge_engine.errors import InvalidConfig, InvalidOption, UnsupportedLayout
from merge_engine.plan.hf_plan import plan_hf_merge
from merge_engine.plan.hub_format import in_weights_format
from merge_engine.plan.merge_plan import parse_size
from merge_engine.formats.tensor_source import TensorMeta


def _metas(**shapes_and_dtypes):
    return {name.replace("__", "."): TensorMeta(name.replace("__", "."), shape, dtype)
            for name, (shape, dtype) in shapes_and_dtypes.items()}


METAS = _metas(model__embed_tokens__weight=((10, 4), torch.float32), lm_head__weight=((10, 4), torch.float32),
               model__position_ids=((1, 8), torch.int64), model__mask=((8,), torch.bool))


def test_dtype_casts_floating_point_tensors_only():
    stored = plan_hf_merge(METAS, {"model_type": "llama", "tie_word_embeddings": False}, max_shard_size=None)
    assert {t.name: t.dtype for t in stored.tensors} == {name: meta.dtype for name, meta in METAS.items()}
    assert stored.config_updates["dtype"] == "float32"  # the one floating-point dtype stored
    plan = stored.with_dtype(torch.bfloat16)
    dtypes = {t.name: t.dtype for t in plan.tensors}
    assert dtypes == {"model.embed_tokens.weight": torch.bfloat16, "lm_head.weight": torch.bfloat16,
                      "model.position_ids": torch.int64, "model.mask": torch.bool}
    assert plan.config_updates["dtype"] == "bfloat16"
    assert plan.total_size < stored.total_size and stored.with_dtype(None) is stored


@pytest.mark.parametrize("stored, cast, refused", [
    (torch.float8_e4m3fnuz, torch.bfloat16, False),  # floating point: --dtype makes it storable
    (torch.float8_e4m3fnuz, None, True),
    (torch.complex64, torch.float32, True),  # not floating point: --dtype leaves it as it is
])
def test_what_safetensors_cannot_store_is_refused_after_the_cast(stored, cast, refused):
    metas = {**METAS, "model.rotary": TensorMeta("model.rotary", (4,), stored)}
    config = {"model_type": "llama", "tie_word_embeddings": False}
    plan = plan_hf_merge(metas, config, max_shard_size=None).with_dtype(cast)
    if refused:
        with pytest.raises(UnsupportedLayout, match=f"model.rotary: dtype {stored}"):
            in_weights_format(plan, config, "transformers", 10**9)
    else:
        assert in_weights_format(plan, config, "transformers", 10**9).by_name()["model.rotary"].dtype == cast


def test_a_sharded_plan_is_not_cast():
    sharded = plan_hf_merge(METAS, {"model_type": "llama", "tie_word_embeddings": False}, max_shard_size=10**9)
    with pytest.raises(ValueError, match="before it is sharded"):
        sharded.with_dtype(torch.bfloat16)


def test_tied_lm_head_dropped_only_when_config_ties():
    tied = plan_hf_merge(METAS, {"model_type": "llama", "tie_word_embeddings": True})
    untied = plan_hf_merge(METAS, {"model_type": "llama", "tie_word_embeddings": False})
    assert "lm_head.weight" not in tied.by_name() and "lm_head.weight" in untied.by_name()
    with pytest.raises(InvalidOption):
        plan_hf_merge(METAS, {"model_type": "llama", "tie_word_embeddings": False}, tie_flag=True)
    no_head = {k: v for k, v in METAS.items() if k != "lm_head.weight"}
    with pytest.raises(InvalidConfig):
        plan_hf_merge(no_head, {"model_type": "llama", "tie_word_embeddings": False})


def test_critic_head_becomes_token_classification():
    metas = _metas(model__embed_tokens__weight=((10, 4), torch.float32), score__weight=((1, 4), torch.float32))
    plan = plan_hf_merge(metas, {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"],
                                 "tie_word_embeddings": False})
    assert plan.config_updates["architectures"] == ["Qwen2ForTokenClassification"]
    assert plan.config_updates["id2label"] == {"0": "LABEL_0"}


@pytest.mark.parametrize("text,size", [("5GB", 5 * 10**9), ("500MiB", 500 * 2**20), ("1024", 1024), (7, 7)])
def test_sizes(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["five", "-1GB", "0"])
def test_bad_sizes(text):
    with pytest.raises(InvalidOption):
        parse_size(text)


def test_a_dtype_safetensors_cannot_store_is_refused_at_planning():
    from merge_engine.errors import UnsupportedLayout

    metas = {**METAS, "model.freqs_cis": TensorMeta("model.freqs_cis", (8, 2), torch.complex64)}
    with pytest.raises(UnsupportedLayout, match="model.freqs_cis"):
        plan_hf_merge(metas, {"model_type": "llama", "tie_word_embeddings": False})


def test_tied_without_an_input_embedding_is_refused():
    """Dropping lm_head is only safe when there is an embedding to tie it to (and to check it against)."""
    metas = _metas(lm_head__weight=((10, 4), torch.float32), model__norm__weight=((4,), torch.float32))
    with pytest.raises(InvalidConfig, match="no input embedding"):
        plan_hf_merge(metas, {"model_type": "llama", "tie_word_embeddings": True})
