"""An extracted adapter is named for the Hub-format base written beside it.

Specification (world-size-1 checkpoints of PEFT-wrapped models, transformers v5 in-memory names):
- Mixtral with LoRA on its fused experts: per-expert modules under Mixtral's Hub names
  ``block_sparse_moe.experts.N.w1`` / ``w3`` / ``w2``; PEFT loads it onto the Hub base, logits equal;
- Qwen2-VL (``model.language_model`` in memory): the adapter's modules are the Hub's
  ``model.layers...``; transformers' ``load_adapter`` loads every factor onto the Hub base, logits equal;
- ``--weights-format transformers``: names as stored, the base too; ``PeftModel.from_pretrained``
  loads it with no missing or unexpected key, logits equal.
"""

from __future__ import annotations

import json
import os

import torch
from safetensors import safe_open

from merge_engine.commands.extract import extract_lora
from merge_engine.output.jobs import OutputOptions
from tests.merge_engine.lora.conftest import logits


def _keys(path: str) -> set[str]:
    with safe_open(path, "pt") as handle:
        return set(handle.keys())


def _peft_on_base(target: str, model_class: str = "AutoModelForCausalLM"):
    """PEFT's model of the adapter at ``target`` on its ``base/``; asserts both load cleanly."""
    import peft
    import transformers

    base, info = getattr(transformers, model_class).from_pretrained(os.path.join(target, "base"),
                                                                    output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    model = peft.PeftModel.from_pretrained(base.eval(), target)
    check = model.load_adapter(target, adapter_name="check")
    assert not check.missing_keys and not check.unexpected_keys
    model.set_adapter("default")
    return model


def test_mixtral_experts_under_w1_w3_w2(single_rank_family_loras, tmp_path):
    run = single_rank_family_loras["mixtral"]
    target = str(tmp_path / "adapter")
    extract_lora(run.checkpoint_dir, target, OutputOptions())
    keys = _keys(os.path.join(target, "adapter_model.safetensors"))
    prefix = "base_model.model.model.layers.1.block_sparse_moe.experts.3"
    assert {f"{prefix}.{w}.lora_{f}.weight" for w in ("w1", "w2", "w3") for f in "AB"} <= keys
    assert not any(".mlp.experts" in k for k in keys)
    with open(os.path.join(target, "adapter_config.json")) as handle:
        assert sorted(json.load(handle)["target_modules"]) == ["k_proj", "w1", "w2", "w3"]
    assert torch.equal(logits(_peft_on_base(target)), logits(run.model))


def test_vision_language_modules_under_hub_names(single_rank_family_loras, tmp_path):
    """Loaded the way transformers loads an adapter onto a model (``model.load_adapter``: PEFT with the
    model's key mapping). PEFT 0.21's own ``PeftModel.from_pretrained`` renames only MoE keys for
    transformers v5, not a VL model's: it wants ``--weights-format transformers`` (next test)."""
    import transformers

    run = single_rank_family_loras["qwen2_vl"]
    target = str(tmp_path / "adapter")
    extract_lora(run.checkpoint_dir, target, OutputOptions())
    keys = _keys(os.path.join(target, "adapter_model.safetensors"))
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in keys
    assert not any("language_model" in k for k in keys)
    assert not any("language_model" in k for k in _keys(os.path.join(target, "base", "model.safetensors")))
    model, info = transformers.Qwen2VLForConditionalGeneration.from_pretrained(os.path.join(target, "base"),
                                                                                output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    model.eval()
    assert not torch.equal(logits(model), logits(run.model))  # the adapter changes the logits
    model.load_adapter(target)
    loaded = {n for n, _ in model.named_parameters() if ".lora_" in n}
    assert len(loaded) == len(keys)
    assert torch.equal(logits(model), logits(run.model))


def test_transformers_format_keeps_stored_names(single_rank_family_loras, tmp_path):
    run = single_rank_family_loras["qwen2_vl"]
    target = str(tmp_path / "adapter")
    extract_lora(run.checkpoint_dir, target, OutputOptions(weights_format="transformers"))
    keys = _keys(os.path.join(target, "adapter_model.safetensors"))
    assert "base_model.model.model.language_model.layers.0.self_attn.q_proj.lora_A.weight" in keys
    assert "model.language_model.embed_tokens.weight" in _keys(os.path.join(target, "base", "model.safetensors"))
    with open(os.path.join(target, "stepmerge.json")) as handle:
        assert json.load(handle)["options"]["weights_format"] == "transformers"
    model = _peft_on_base(target, "Qwen2VLForConditionalGeneration")
    assert torch.equal(logits(model), logits(run.model))


def test_validation_of_hub_named_adapters(single_rank_family_loras, tmp_path):
    """validate_adapter (what the pipeline runs before publishing) passes the Hub-named VL and MoE adapters
    against the fused model of the same checkpoint: the adapter reproduces it (``peft_logits``)."""
    from merge_engine.commands.merge import merge_checkpoint
    from merge_engine.validate.adapter import validate_adapter

    for family in ("qwen2_vl", "mixtral"):
        run = single_rank_family_loras[family]
        adapter, fused = str(tmp_path / family / "adapter"), str(tmp_path / family / "fused")
        extract_lora(run.checkpoint_dir, adapter, OutputOptions())
        merge_checkpoint(run.checkpoint_dir, fused)
        report = validate_adapter(adapter, fused_model_url=fused, device="cpu")
        checks = {c.name: c for c in report.checks}
        assert report.ok and checks["peft_logits"].ok, [c for c in report.checks if not c.ok]


def test_qwen2_moe_in_peft_fused_form(single_rank_family_loras, tmp_path):
    """Qwen2-MoE: PEFT 0.21 cannot load per-expert adapters onto it under transformers v5; the
    transformers weights format gives the fused form, which PEFT loads exactly (no missing key)."""
    run = single_rank_family_loras["qwen2_moe"]
    target = str(tmp_path / "adapter")
    extract_lora(run.checkpoint_dir, target, OutputOptions(weights_format="transformers"))
    assert torch.equal(logits(_peft_on_base(target)), logits(run.model))


def test_hub_tensors_must_cover_the_fused_tensor_once():
    """A conversion that left an expert out (or cut one twice) would drop (or double) part of the LoRA:
    refused, never written."""
    import pytest

    from merge_engine.errors import AdapterError
    from merge_engine.lora.hub_names import _check_covered
    from merge_engine.plan.transformers_conversion import TensorView

    def expert(e: int) -> tuple[str, TensorView]:
        return f"experts.{e}.down_proj.weight", TensorView("experts.down_proj", e * 12, (3, 4), (4, 1))

    _check_covered([expert(1), expert(0)], 24, "experts.down_proj", "ckpt")
    for views in ([expert(0)], [expert(0), expert(0), expert(1)], [expert(1)]):
        with pytest.raises(AdapterError, match="exactly once"):
            _check_covered(views, 24, "experts.down_proj", "ckpt")
