"""verl's default LoRA (all-linear, r 4, alpha 16) on transformers-5 MoE models: the outputs are the TRAINED model.

Specification (issue 16, items 1, 2 and 5), for every MoE family of the FSDP matrix (`verl_lora_runs`: FSDP2,
world 2, written on gloo; the trained model is the PeftModel that PEFT builds from the same settings and
weights, never stepmerge code):
- ``merge`` reproduces the trained model's logits within 1e-4 of their scale (PEFT 0.21 gave the fused gate/up
  rank 2r AND alpha 2 * alpha; a global alpha halves every expert's gate/up update);
- ``extract-lora``'s Hub-format adapter (per-expert modules) and its transformers-format adapter (PEFT's
  ``target_parameters``) load in PEFT 0.21 with ``PeftModel.from_pretrained`` AND ``model.load_adapter`` onto
  the ``base/`` written beside them, with no missing or unexpected key, and give those logits;
- ``merge-lora`` of the Hub adapter onto that base gives them too (the adapter's patterns read by stepmerge,
  each module's applied scale recorded in its ``stepmerge.json``);
- ``stepmerge.json`` records each module's (r, lora_alpha, scaling) as PEFT resolved them, and the written
  ``adapter_config.json`` gives each module its trained scaling;
- the fixture's LoRA moves the logits by more than 1 % of their scale, so a wrong scale cannot pass.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from merge_engine.commands.combine import merge_lora
from merge_engine.output.jobs import OutputOptions
from merge_engine.commands.extract import extract_lora
from merge_engine.commands.merge import merge_checkpoint
from synthetic_runs.fsdp import MOE_FAMILIES, build_reference_model

TOKENS = torch.arange(1, 41).reshape(2, 20)
TOLERANCE = 1e-4  # of the logits' scale (max |logit|)


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=TOKENS).logits.float()


def _load(path: str) -> torch.nn.Module:
    """The folder's model as transformers loads it (a vision-language model through its image-text class)."""
    import transformers

    with open(os.path.join(path, "config.json")) as handle:
        architecture = json.load(handle)["architectures"][0]
    auto = transformers.AutoModelForImageTextToText if "ConditionalGeneration" in architecture \
        else transformers.AutoModelForCausalLM
    return auto.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def trained(verl_lora_runs):
    """family -> (checkpoint dir, the trained PeftModel's logits, the base model's logits)."""
    out = {}
    for family in MOE_FAMILIES:
        step = verl_lora_runs[f"{family}_verl_lora_w2"].latest
        model = build_reference_model(step.spec, step.seed).eval()
        with model.disable_adapter():
            base = _logits(model)
        out[family] = (step.checkpoint_dir, _logits(model), base)
    return out


def _close(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got - expected).abs().max() / expected.abs().max())


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_merge_is_the_trained_model(trained, family, tmp_path):
    """merge == the trained PeftModel within 1e-4 of the logits' scale (the LoRA itself moves them > 1 %), and
    stepmerge.json records every module's PEFT settings."""
    checkpoint, expected, base = trained[family]
    assert _close(base, expected) > 0.01
    target = str(tmp_path / "merged")
    merge_checkpoint(checkpoint, target)
    assert _close(_logits(_load(target)), expected) < TOLERANCE
    with open(os.path.join(target, "stepmerge.json")) as handle:
        record = json.load(handle)["lora"]["peft_settings"]
    assert record["source"] == "verl's default target_modules all-linear"
    assert record["lora_config"]["target_modules"] == "all-linear" and record["modules"]
    for module, settings in record["modules"].items():
        assert settings["scaling"] == 4.0, module
        fused = settings.get("parameter") == "gate_up_proj"
        assert (settings["r"], settings["lora_alpha"]) == ((8, 32) if fused else (4, 16)), module


@pytest.mark.parametrize("family", MOE_FAMILIES)
@pytest.mark.parametrize("weights_format", ["hub", "transformers"])
def test_extracted_adapter_loads_in_peft_as_trained(trained, family, weights_format, tmp_path):
    """The adapter loads onto its base/ with PeftModel.from_pretrained and with model.load_adapter (no missing
    or unexpected key) and gives the trained logits; merge-lora of it gives them too."""
    import peft

    checkpoint, expected, _ = trained[family]
    adapter = str(tmp_path / "adapter")
    extract_lora(checkpoint, adapter, OutputOptions(weights_format=weights_format))
    base_dir = os.path.join(adapter, "base")
    model = peft.PeftModel.from_pretrained(_load(base_dir), adapter).eval()
    assert _close(_logits(model), expected) < TOLERANCE
    check = model.load_adapter(adapter, adapter_name="check")
    assert not check.missing_keys and not check.unexpected_keys
    plain = _load(base_dir)
    plain.load_adapter(adapter)
    assert _close(_logits(plain), expected) < TOLERANCE
    with open(os.path.join(adapter, "stepmerge.json")) as handle:
        assert json.load(handle)["lora"]["peft_settings"]["modules"]
    if weights_format == "hub":
        fused = str(tmp_path / "fused")
        merge_lora(base_dir, [adapter], fused, OutputOptions())
        assert _close(_logits(_load(fused)), expected) < TOLERANCE
        with open(os.path.join(fused, "stepmerge.json")) as handle:
            applied = json.load(handle)["lora"]["adapter_settings"][adapter]
        assert applied and {settings["scaling"] for settings in applied.values()} == {4.0}


def test_a_step_saved_by_verls_own_checkpoint_manager(verl_saved_lora_run, verl_lora_runs, trained, tmp_path):
    """verl 0.9.1's FSDPCheckpointManager (run with this project's transformers and peft) saves the same tensors
    and lora_train_meta.json as the synthetic writer; merge and the Hub adapter give the trained model."""
    import peft
    import torch.distributed.tensor  # noqa: F401 - DTensor, for torch.load(weights_only=True)

    from tests.synthetic_runs.test_fsdp_writer import _rank_states, _reassemble

    step = verl_saved_lora_run.latest
    saved, ours = _reassemble(_rank_states(step)), _reassemble(_rank_states(verl_lora_runs["mixtral_verl_lora_w2"].latest))
    assert saved.keys() == ours.keys() and all(torch.equal(saved[k], ours[k]) for k in ours)
    with open(os.path.join(step.checkpoint_dir, "lora_train_meta.json")) as handle:
        assert json.load(handle) == {"r": 4, "lora_alpha": 16, "task_type": "CAUSAL_LM"}
    _, expected, _ = trained["mixtral"]
    merge_checkpoint(step.checkpoint_dir, str(tmp_path / "merged"))
    assert _close(_logits(_load(str(tmp_path / "merged"))), expected) < TOLERANCE
    adapter = str(tmp_path / "adapter")
    extract_lora(step.checkpoint_dir, adapter, OutputOptions())
    model = peft.PeftModel.from_pretrained(_load(os.path.join(adapter, "base")), adapter).eval()
    assert _close(_logits(model), expected) < TOLERANCE
