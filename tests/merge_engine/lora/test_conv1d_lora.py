"""LoRA on Conv1D layers (GPT-2: weights stored (in, out); PEFT wraps them with fan_in_fan_out).

Specification (a real FSDP2 checkpoint of a PEFT-wrapped GPT-2, world 2, whose run recorded only
r and lora_alpha, as verl does):
- ``merge`` writes the trained model: every update fused as (B @ A).T into its (in, out) weight; its
  logits equal the PEFT model's it was trained as;
- ``extract-lora`` writes an adapter with ``fan_in_fan_out`` (the model's Conv1D layers decide) that
  PEFT loads onto the written base and that reproduces the same logits.
"""

from __future__ import annotations

import json
import os

import torch

from merge_engine.commands.extract import extract_lora
from merge_engine.output.jobs import OutputOptions
from merge_engine.commands.merge import merge_checkpoint
from synthetic_runs.fsdp import build_reference_model

CASE = "gpt2_lora_w2"


def _logits(model: torch.nn.Module) -> torch.Tensor:
    ids = torch.tensor([[(7919 * i + 13) % 1003 for i in range(12)]])
    with torch.no_grad():
        return model.eval()(input_ids=ids).logits


def test_merge_and_adapter_reproduce_the_trained_model(family_runs, tmp_path):
    import peft
    import transformers

    step = family_runs[CASE].latest
    trained = _logits(build_reference_model(step.spec, step.seed))

    merge_checkpoint(step.checkpoint_dir, str(tmp_path / "merged"))
    merged = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path / "merged"))
    torch.testing.assert_close(_logits(merged), trained, atol=1e-5, rtol=1e-5)

    extract_lora(step.checkpoint_dir, str(tmp_path / "adapter"), OutputOptions())
    with open(tmp_path / "adapter" / "adapter_config.json") as handle:
        assert json.load(handle)["fan_in_fan_out"] is True
    base = transformers.GPT2LMHeadModel.from_pretrained(os.path.join(tmp_path, "adapter", "base"))
    adapted = peft.PeftModel.from_pretrained(base, str(tmp_path / "adapter"))
    torch.testing.assert_close(_logits(adapted), trained, atol=1e-5, rtol=1e-5)
