"""LoRA on fused expert tensors (PEFT 0.21 ``target_parameters`` on transformers v5 MoE).

Specification:
- PEFT's layout is read as PEFT computes it: expert e's update is ``B[:, e::E] @ A[e*r:(e+1)*r]``
  (checked against ``ParamWrapper.get_delta_weight``); which parameter a wrapper adapts is told by
  the factor shapes, and a wrapper that fits none, or experts stored (experts, in, out), are refused
  with `AdapterError`;
- ``extract-lora`` of a real FSDP2 checkpoint of a PEFT-wrapped Qwen3-MoE (LoRA on ``q_proj``,
  ``v_proj`` and both fused expert tensors, world 2) writes per-expert modules under the Hub names
  (``experts.N.gate_proj`` / ``up_proj`` / ``down_proj``, A_e and B_e cut bit for bit from the fused
  factors) and its ``base/`` in the Hub format; PEFT loads the adapter onto that base with no missing
  or unexpected key and reproduces the trained model's logits exactly;
- a plain ``merge`` fuses the expert LoRA into the trained model (Hub names, logits equal);
- ``--weights-format transformers`` keeps PEFT's fused form (``target_parameters``), which PEFT loads onto the
  transformers-format base exactly.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors import safe_open

from merge_engine.errors import AdapterError
from merge_engine.commands.extract import extract_lora
from merge_engine.output.jobs import OutputOptions
from merge_engine.lora.fused_experts import find_expert_loras
from merge_engine.commands.merge import merge_checkpoint
from merge_engine.formats.tensor_source import TensorMeta
from tests.merge_engine.lora.conftest import load_causal_lm, logits

CASE = "qwen3_moe_lora_w2"
LAYER = "base_model.model.model.layers.0.mlp.experts"


def expert_factors(a: torch.Tensor, b: torch.Tensor, expert: int, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(A_e, B_e) of expert ``expert`` from PEFT's fused factors: ``A[e*r:(e+1)*r]``, ``B[:, e::E]``."""
    rank = a.shape[0] // num_experts
    return a[expert * rank:(expert + 1) * rank], b[:, expert::num_experts]


def _keys(path: str) -> set[str]:
    with safe_open(path, "pt") as handle:
        return set(handle.keys())


def _tensors(path: str) -> dict[str, torch.Tensor]:
    with safe_open(path, "pt") as handle:
        return {key: handle.get_tensor(key) for key in handle.keys()}


@pytest.fixture(scope="module")
def moe_run(family_runs):
    from synthetic_runs.fsdp import build_reference_model

    step = family_runs[CASE].latest
    return step.checkpoint_dir, build_reference_model(step.spec, step.seed).eval()


def test_expert_factors_are_peft_own_delta():
    """expert_factors(A, B, e) reproduces ParamWrapper.get_delta_weight for every expert of both
    wrappers, and find_expert_loras tells the two wrappers apart by their shapes."""
    import peft

    from synthetic_runs.models import ModelSpec, build_model
    from tests.merge_engine.lora.conftest import fill_lora_

    model = peft.get_peft_model(build_model(ModelSpec(family="qwen3_moe"), seed=3), peft.LoraConfig(
        r=2, lora_alpha=6, target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]))
    fill_lora_(model, seed=4)
    state = model.state_dict()
    metas = {k: TensorMeta(k, tuple(v.shape), v.dtype) for k, v in state.items()}
    base = {"model.layers.0.mlp.experts.gate_up_proj": tuple(state[f"{LAYER}.base_layer.base_layer.gate_up_proj"].shape),
            "model.layers.0.mlp.experts.down_proj": tuple(state[f"{LAYER}.base_layer.base_layer.down_proj"].shape)}
    factors = {f"model.layers.0.mlp.experts{suffix}": {"lora_A": (f"{LAYER}{suffix}.lora_A.default.weight", False),
                                                         "lora_B": (f"{LAYER}{suffix}.lora_B.default.weight", False)}
               for suffix in ("", ".base_layer")}
    experts, ordinary = find_expert_loras(factors, base, metas, "ckpt")
    assert not ordinary
    wrappers = model.base_model.model.model.layers[0].mlp.experts
    for parameter, wrapper in (("gate_up_proj", wrappers.base_layer), ("down_proj", wrappers)):
        lora = experts[f"model.layers.0.mlp.experts.{parameter}"]
        assert lora.a.startswith(f"{LAYER}.base_layer." if parameter == "gate_up_proj" else f"{LAYER}.lora_")
        assert (lora.num_experts, lora.rank) == (4, 2)
        delta = wrapper.get_delta_weight("default")
        for expert in range(lora.num_experts):
            a, b = expert_factors(state[lora.a], state[lora.b], expert, lora.num_experts)
            torch.testing.assert_close(3.0 * b @ a, delta[expert], rtol=0, atol=1e-6)
    bad = {"model.layers.0.mlp.experts": {"lora_A": (f"{LAYER}.lora_A.default.weight", False),
                                          "lora_B": (f"{LAYER}.base_layer.lora_B.default.weight", False)}}
    with pytest.raises(AdapterError, match="fits none"):
        find_expert_loras(bad, base, metas, "ckpt")
    # experts stored (experts, in, out) (transformers' is_transposed: gpt-oss): a square one would fit
    # either way round, so they are refused, never guessed
    with pytest.raises(AdapterError, match="stored \\(experts, in, out\\)"):
        find_expert_loras(factors, base, metas, "ckpt", frozenset({"model.layers.0.mlp.experts"}))


def test_extract_writes_per_expert_hub_modules(moe_run, tmp_path):
    """The adapter holds experts.N.{gate,up,down}_proj cut bit for bit from the fused factors, its base
    the Hub names; PEFT loads it onto that base cleanly and the logits equal the trained model's."""
    import peft

    checkpoint, trained = moe_run
    target = str(tmp_path / "adapter")
    extract_lora(checkpoint, target, OutputOptions())

    adapter = _tensors(os.path.join(target, "adapter_model.safetensors"))
    assert not any("gate_up_proj" in k or "base_layer" in k for k in adapter)
    state = trained.state_dict()
    fused_a = state[f"{LAYER}.base_layer.lora_A.default.weight"]  # gate_up_proj: (E*r, H), (2I, E*r)
    fused_b = state[f"{LAYER}.base_layer.lora_B.default.weight"]
    half = fused_b.shape[0] // 2
    for expert in range(4):
        a, b = expert_factors(fused_a, fused_b, expert, 4)
        prefix = f"base_model.model.model.layers.0.mlp.experts.{expert}"
        assert torch.equal(adapter[f"{prefix}.gate_proj.lora_A.weight"], a)
        assert torch.equal(adapter[f"{prefix}.up_proj.lora_A.weight"], a)
        assert torch.equal(adapter[f"{prefix}.gate_proj.lora_B.weight"], b[:half])
        assert torch.equal(adapter[f"{prefix}.up_proj.lora_B.weight"], b[half:])
    with open(os.path.join(target, "adapter_config.json")) as handle:
        config = json.load(handle)
    assert sorted(config["target_modules"]) == ["down_proj", "gate_proj", "q_proj", "up_proj", "v_proj"]
    assert (config["r"], config["lora_alpha"], config["rank_pattern"]) == (2, 4, {})

    base_keys = _keys(os.path.join(target, "base", "model.safetensors"))
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in base_keys
    assert not any("gate_up_proj" in k for k in base_keys)
    with open(os.path.join(target, "stepmerge.json")) as handle:
        assert json.load(handle)["options"]["weights_format"] == "hub"

    from transformers import AutoModelForCausalLM

    base, info = AutoModelForCausalLM.from_pretrained(os.path.join(target, "base"), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    model = peft.PeftModel.from_pretrained(base.eval(), target)
    check = model.load_adapter(target, adapter_name="check")
    assert not check.missing_keys and not check.unexpected_keys
    model.set_adapter("default")
    assert torch.equal(logits(model), logits(trained))


def test_lora_only_checkpoint_checked_against_a_hub_base(moe_run, tmp_path):
    """A LoRA-only save (no frozen tensor in the rank files): the fused expert wrappers are told apart
    by the model's in-memory shapes (meta device), the adapter is checked against the Hub-format base
    given with --base-model, and equals the adapter extracted from the full checkpoint."""
    import torch.distributed.tensor  # noqa: F401 - DTensor must be importable to load these files

    from tests.merge_engine.lora.conftest import copy_checkpoint

    checkpoint, _ = moe_run
    full = str(tmp_path / "full")
    extract_lora(checkpoint, full, OutputOptions())
    lora_only = copy_checkpoint(checkpoint, str(tmp_path / "lora_only"))
    for name in os.listdir(lora_only):
        if name.startswith("model_world_size_"):
            state = torch.load(os.path.join(lora_only, name), weights_only=True)
            torch.save({k: v for k, v in state.items() if ".lora_" in k}, os.path.join(lora_only, name))
    target = str(tmp_path / "adapter")
    extract_lora(lora_only, target, OutputOptions(base_model=os.path.join(full, "base")))
    expected = _tensors(os.path.join(full, "adapter_model.safetensors"))
    got = _tensors(os.path.join(target, "adapter_model.safetensors"))
    assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in got)


def test_merge_fuses_the_expert_lora(moe_run, tmp_path):
    """A plain merge writes the trained model (every expert's B_e @ A_e fused) under the Hub names."""
    checkpoint, trained = moe_run
    merge_checkpoint(checkpoint, str(tmp_path / "merged"))
    keys = _keys(str(tmp_path / "merged" / "model.safetensors"))
    assert "model.layers.0.mlp.experts.2.gate_proj.weight" in keys and not any("lora" in k for k in keys)
    torch.testing.assert_close(logits(load_causal_lm(str(tmp_path / "merged"))), logits(trained),
                               rtol=1e-5, atol=1e-5)


def test_transformers_format_keeps_peft_fused_form(moe_run, tmp_path):
    """--weights-format transformers: base/ keeps the fused tensors and the adapter PEFT's own
    target_parameters form (the trained factors, bit for bit); PEFT loads it with no missing or
    unexpected key and reproduces the trained model's logits."""
    import peft

    checkpoint, trained = moe_run
    target = str(tmp_path / "adapter")
    extract_lora(checkpoint, target, OutputOptions(weights_format="transformers"))
    adapter = _tensors(os.path.join(target, "adapter_model.safetensors"))
    state = trained.state_dict()
    for wrapper in (f"{LAYER}.base_layer", LAYER):
        for factor in ("lora_A", "lora_B"):
            assert torch.equal(adapter[f"{wrapper}.{factor}.weight"], state[f"{wrapper}.{factor}.default.weight"])
    with open(os.path.join(target, "adapter_config.json")) as handle:
        config = json.load(handle)
    assert config["target_parameters"] == ["mlp.experts.down_proj", "mlp.experts.gate_up_proj"]
    assert sorted(config["target_modules"]) == ["q_proj", "v_proj"]
    assert "model.layers.0.mlp.experts.gate_up_proj" in _keys(os.path.join(target, "base", "model.safetensors"))
    from transformers import AutoModelForCausalLM

    model = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(os.path.join(target, "base")).eval(),
                                           target)
    check = model.load_adapter(target, adapter_name="check")
    assert not check.missing_keys and not check.unexpected_keys
    model.set_adapter("default")
    assert torch.equal(logits(model), logits(trained))


def test_fused_form_adapter_is_read_back(moe_run, tmp_path):
    """The fused-form adapter is read by stepmerge too: validate_adapter passes it against the trained
    model (merged in the same format), merge-lora fuses it into its base/ to that model (bit for bit),
    and combining it into one adapter is refused with a named error."""
    from merge_engine.commands.combine import merge_lora
    from merge_engine.output.jobs import OutputOptions
    from merge_engine.validate.adapter import validate_adapter

    checkpoint, trained = moe_run
    adapter, merged = str(tmp_path / "adapter"), str(tmp_path / "merged")
    extract_lora(checkpoint, adapter, OutputOptions(weights_format="transformers"))
    merge_checkpoint(checkpoint, merged, OutputOptions(weights_format="transformers"))
    report = validate_adapter(adapter, fused_model_url=merged, device="cpu")
    assert report.ok, [c for c in report.checks if not c.ok]
    fused = str(tmp_path / "fused")
    merge_lora(os.path.join(adapter, "base"), [adapter], fused, OutputOptions(weights_format="transformers"))
    got, expected = _tensors(os.path.join(fused, "model.safetensors")), _tensors(os.path.join(merged, "model.safetensors"))
    assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in got)
    with pytest.raises(AdapterError, match="fused expert tensors"):
        merge_lora(os.path.join(adapter, "base"), [adapter], str(tmp_path / "combined"),
                   OutputOptions(output="adapter"))
