"""The planner (`merge_engine.planner`) picks the plan from the layout's tensor naming, once.

Specification: Hugging Face names are planned under their own names; ``--custom-mapping`` is refused
for them (it extends Megatron tables); every layout declares how it names its tensors; the one tied
rule refuses a stored head that differs from the embedding it is said to be tied to, as `InvalidConfig`.
"""

from __future__ import annotations

import pytest
import torch

from merge_engine.errors import InvalidConfig, InvalidOption
from merge_engine.layouts import HF_NAMES, LAYOUTS, MEGATRON_NAMES, check_checkpoint, open_checkpoint
from merge_engine.planner import check_tied_copy, plan_checkpoint
from tests.merge_engine.output.test_jobs import TENSORS, _hf_folder


def test_every_layout_says_how_it_names_its_tensors():
    assert {layout.name: layout.tensor_naming for layout in LAYOUTS} == {
        "fsdp": HF_NAMES, "megatron_legacy": MEGATRON_NAMES, "megatron_bridge": HF_NAMES,
        "megatron_dist": MEGATRON_NAMES, "megatron_lora": MEGATRON_NAMES, "torch_dcp": HF_NAMES, "torchtitan": HF_NAMES,
        "dcp_hf": HF_NAMES,
        "deepspeed_zero": HF_NAMES, "hf": HF_NAMES}


def test_hf_names_are_planned_as_they_are_and_custom_mappings_refused(tmp_path):
    checkpoint = check_checkpoint(_hf_folder(tmp_path))
    source = open_checkpoint(checkpoint)
    try:
        config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "tie_word_embeddings": False}
        plan = plan_checkpoint(checkpoint, source, config, max_shard_size=10**9)
        assert [t.name for t in plan.tensors] == list(source.metas())
        assert [t.dtype for t in plan.tensors] == [meta.dtype for meta in source.metas().values()]
        with pytest.raises(InvalidOption, match="custom-mapping"):
            plan_checkpoint(checkpoint, source, config, max_shard_size=10**9, custom_mapping="x.json")
    finally:
        source.close()


def test_a_tied_copy_that_differs_is_an_invalid_config(tmp_path):
    source = open_checkpoint(check_checkpoint(_hf_folder(tmp_path)))
    try:
        assert not torch.equal(TENSORS["lm_head.weight"], TENSORS["model.embed_tokens.weight"])
        with pytest.raises(InvalidConfig, match="lm_head.weight differs from model.embed_tokens.weight"):
            check_tied_copy(source, "lm_head.weight", "model.embed_tokens.weight", 64)
        check_tied_copy(source, "model.embed_tokens.weight", "model.embed_tokens.weight", 64)  # equal: passes
    finally:
        source.close()
