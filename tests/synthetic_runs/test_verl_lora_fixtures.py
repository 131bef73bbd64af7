"""verl's default LoRA on every MoE family (`synthetic_runs.fsdp.verl_lora_matrix()`), checked as a fixture.

Specification:
- every family of the FSDP matrix's MoE set is there, FSDP2 at world 2, with verl's LoRA settings
  (``all-linear``, r 4, alpha 16) and verl's ``lora_train_meta.json`` (r, lora_alpha, task_type only);
- the rank files reassemble to the reference bit for bit, and the reference is the PEFT model that
  ``peft.get_peft_model`` builds from the same settings and weights in this process;
- the LoRA moves the logits by more than 1 % of their scale (a wrong scale shows);
- where PEFT 0.21 adapts the fused experts (Mixtral, Qwen3-MoE, DeepSeek-V3), the stored gate/up factors
  have rank 2r per expert and PEFT gave them alpha 2 * alpha: the case that a global alpha gets wrong.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from synthetic_runs.fsdp import MOE_FAMILIES, VERL_DEFAULT_LORA, build_reference_model
from tests.synthetic_runs.test_fsdp_writer import _rank_states, _reassemble

TOKENS = torch.arange(1, 41).reshape(2, 20)
FUSED_GATE_UP = ("mixtral", "qwen3_moe", "deepseek_v3")  # where PEFT 0.21's all-linear adapts the experts


def test_every_moe_family_has_a_verl_default_lora_run(verl_lora_runs):
    """One run per MoE family, FSDP2 world 2, verl's LoRA settings and metadata file."""
    assert {run.spec.model.family for run in verl_lora_runs.values()} == set(MOE_FAMILIES)
    for name, run in verl_lora_runs.items():
        assert (run.spec.strategy, run.spec.world_size, run.spec.lora) == ("fsdp2", 2, VERL_DEFAULT_LORA), name
        assert VERL_DEFAULT_LORA.alpha != 2 * VERL_DEFAULT_LORA.r
        with open(f"{run.latest.checkpoint_dir}/lora_train_meta.json") as handle:
            assert json.load(handle) == {"r": 4, "lora_alpha": 16, "task_type": "CAUSAL_LM"}


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_shards_are_the_peft_model_and_the_lora_shows(verl_lora_runs, family):
    """Rank files == reference == PEFT's model; the LoRA moves the logits by > 1 % of their scale; the
    fused gate/up is rank 2r with alpha 2 * alpha where PEFT adapts the experts."""
    step = verl_lora_runs[f"{family}_verl_lora_w2"].latest
    full = _reassemble(_rank_states(step))
    reference = load_file(step.reference_state_dict)
    assert set(full) == set(reference) and all(torch.equal(full[k], reference[k]) for k in reference)
    trained = build_reference_model(step.spec, step.seed).eval()
    state = trained.state_dict()
    assert all(torch.equal(state[k], reference[k]) for k in reference)
    with torch.no_grad():
        lora = trained(input_ids=TOKENS).logits
        with trained.disable_adapter():
            base = trained(input_ids=TOKENS).logits
    assert (lora - base).abs().max() > 0.01 * lora.abs().max()
    wrappers = {name: module for name, module in trained.named_modules()
                if getattr(module, "parameter_name", None) == "gate_up_proj"}
    if family in FUSED_GATE_UP:
        assert wrappers
        for module in wrappers.values():
            assert (module.r["default"], module.lora_alpha["default"]) == (8, 32)
            assert module.scaling["default"] == 4.0
    else:  # PEFT 0.21 leaves these experts alone (gpt-oss: (experts, in, out); Qwen2-MoE / Qwen3-VL-MoE: no rule)
        assert not wrappers


def test_writer_choice_is_checked():
    """Who saves a step is "stepmerge" (this repo's re-creation of verl's files) or "verl" (verl's own manager,
    actor steps only); anything else is refused when the spec is made."""
    from synthetic_runs import FsdpSpec

    assert FsdpSpec().writer == "stepmerge"
    with pytest.raises(ValueError, match="writer"):
        FsdpSpec(writer="megatron")
    with pytest.raises(ValueError, match="actor"):
        FsdpSpec(writer="verl", role="critic")
