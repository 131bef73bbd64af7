"""verl Megatron LoRA steps (verl 0.9.1 + Megatron-Bridge PEFT) -> adapter releases and fused models.

The steps are written once per session by `synthetic_runs.megatron_lora` (a writer of our own:
Megatron-Bridge does not run here, see its docstring), from known factors, for a tiny Qwen2 and a
tiny Qwen3-MoE, at TP 2, PP 2 and TP 2 x EP 2, with ``use_dist_checkpointing`` false (adapter only
in model/dist_ckpt + the PEFT export) and true (base and adapter in model/dist_ckpt, no export).

Specification:
- discovery calls an adapter-only step ``megatron_lora`` (complete; the reason says a fused model
  needs --base-model), never a mergeable ``megatron_dist``; without ckpt_contents.json it is incomplete;
- ``check`` names the layout; ``merge`` without a base raises `BaseModelRequired` (exit 2) naming
  what to pass and writes nothing; with ``--base-model`` it writes the trained model, tensor for
  tensor equal to base + (alpha / r) B @ A of the known factors; a base of another model is refused;
- a ``use_dist_checkpointing`` step merges from itself (``--lora-alpha`` required: it records none);
- ``extract-lora`` releases the run's PEFT export as it is, after checking it against the adapter in
  model/dist_ckpt (a tampered export is refused); without an export it builds the adapter from
  model/dist_ckpt exactly (q/k/v and gate/up cuts, grouped experts per expert);
- PEFT applied to the base gives the fused release's logits, and both give the logits of the
  trained model computed from the Megatron factors (the reference).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from merge_engine.cli import main
from merge_engine.layouts.discovery import discover, discover_step
from merge_engine.errors import AdapterError, BaseModelRequired, InvalidConfig
from merge_engine.output.jobs import OutputOptions
from merge_engine.layouts import check_checkpoint
from merge_engine.commands.extract import extract_lora
from merge_engine.commands.merge import merge_checkpoint
from synthetic_runs.megatron_lora import reference_fused_state
from tests.fixtures_checkpoints import LORA_ALPHA as ALPHA
from tests.merge_engine.lora.conftest import load_causal_lm, logits


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(file)))
    return out


def _assert_trained_model(folder: Path, step) -> None:
    got, want = _tensors(folder), reference_fused_state(step)
    assert set(got) == set(want)
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name


# -------------------------------------------------------------------------------------------------
# 1. the layout: discovery, check


def test_discovery_calls_an_adapter_step_megatron_lora_not_a_mergeable_dist_checkpoint(lora_steps):
    step = lora_steps["dense_tp2"]
    found = discover(str(step.step_dir.parent.parent)).steps
    assert [(s.layout, s.status) for s in found] == [("megatron_lora", "complete")]
    assert "--base-model" in found[0].reason
    assert found[0].layouts[0] == "megatron_lora"


@pytest.mark.parametrize(("name", "needs"), [
    ("dense_tp2", ("base_model",)),
    ("dense_tp2_noexport", ("base_model", "lora_alpha")),
    ("dense_tp2_dist", ("lora_alpha", "hf_model_path")),
    ("dense_pp2_dist", ("lora_alpha", "hf_model_path")),
    ("moe_ep2_dist", ("lora_alpha", "hf_model_path")),
])
def test_discovery_reads_verls_marker_and_says_what_a_merge_needs(lora_steps, name, needs):
    """use_dist_checkpointing and no-export steps list like plain dist checkpoints; discovery reads
    ckpt_contents.json (no weight byte) and calls them megatron_lora with the parameters they lack."""
    step = lora_steps[name]
    [found] = discover(str(step.step_dir.parent.parent)).steps
    assert (found.layout, found.status, found.needs) == ("megatron_lora", "complete", needs)
    assert all(n in found.reason for n in needs)
    assert discover_step(str(step.step_dir.parent.parent), 1, "actor") == found


def test_a_marker_without_peft_or_unreadable_leaves_the_listing_verdict(lora_steps, tmp_path):
    src = lora_steps["dense_tp2_dist"].step_dir
    copy = tmp_path / "run" / "global_step_1" / "actor"
    shutil.copytree(src, copy)
    marker = copy / "ckpt_contents.json"
    contents = json.loads(marker.read_text())
    contents["backend"]["peft"] = False
    contents["contents"]["model"].pop("peft_adapter_path", None)
    marker.write_text(json.dumps(contents))
    [step] = discover(str(tmp_path / "run")).steps
    assert (step.layout, step.needs) == ("megatron_dist", ())
    for broken in ('{"backend": {"peft": tr', "[" * 100_000, " " * (2 << 20)):  # cut, too deep, too large
        marker.write_text(broken)
        [step] = discover(str(tmp_path / "run")).steps
        assert (step.layout, step.status, step.needs) == ("megatron_dist", "complete", ())


def test_a_step_without_its_marker_is_incomplete(lora_steps, tmp_path):
    src = lora_steps["moe_tp2_ep2"].step_dir
    copy = tmp_path / "run" / "global_step_1" / "actor"
    shutil.copytree(src, copy)
    (copy / "ckpt_contents.json").unlink()
    [step] = discover(str(tmp_path / "run")).steps
    assert (step.layout, step.status) == ("megatron_lora", "incomplete")


def test_check_names_the_layout_and_what_the_step_holds(lora_steps, capsys):
    adapter_only = check_checkpoint(str(lora_steps["dense_pp2"].step_dir))
    assert adapter_only.layout == "megatron_lora"
    assert (adapter_only.lora, adapter_only.adapter_only) == (True, True)  # typed facts, not notes parsed back
    assert adapter_only.adapter_dir == "model/huggingface/adapter/"
    assert adapter_only.parallel == {"tp": 1, "pp": 2, "ep": 1}
    with_base = check_checkpoint(str(lora_steps["dense_tp2_dist"].step_dir))  # listed as a dist checkpoint
    assert with_base.layout == "megatron_lora"
    assert (with_base.lora, with_base.adapter_only, with_base.adapter_dir) == (True, False, None)
    assert main(["check", "--local_dir", str(lora_steps["moe_tp2_ep2"].step_dir)]) == 0
    assert "megatron_lora" in capsys.readouterr().out


# -------------------------------------------------------------------------------------------------
# 3. the fused model


def test_merge_without_a_base_is_a_named_error_saying_what_to_pass(lora_steps, tmp_path, capsys):
    step = lora_steps["dense_tp2"]
    target = tmp_path / "out"
    with pytest.raises(BaseModelRequired, match="--base-model") as caught:
        merge_checkpoint(str(step.step_dir), str(target), OutputOptions())
    assert str(step.base_dir) in caught.value.message  # the run's recorded base, offered as a hint only
    assert main(["merge", "--local_dir", str(step.step_dir), "--target_dir", str(target)]) == 2
    assert "BaseModelRequired" in capsys.readouterr().err
    assert not target.exists()


@pytest.mark.parametrize("name", ["dense_tp2", "dense_pp2", "llama_tp2", "moe_tp2_ep2"])
def test_merge_with_the_base_writes_the_trained_model(lora_steps, tmp_path, name):
    step = lora_steps[name]
    target = tmp_path / "model"
    assert main(["merge", "--backend", "megatron", "--local_dir", str(step.step_dir), "--target_dir", str(target),
                 "--base-model", str(step.base_dir)]) == 0
    _assert_trained_model(target, step)
    assert json.loads((target / "config.json").read_text())["model_type"] == step.spec.model.family


def test_a_base_of_another_model_is_refused(lora_steps, tmp_path):
    step = lora_steps["dense_tp2"]
    other = lora_steps["moe_tp2_ep2"].base_dir
    with pytest.raises(InvalidConfig, match="not the model this run trained") as error:
        merge_checkpoint(str(step.step_dir), str(tmp_path / "out"), OutputOptions(base_model=str(other)))
    step_config = os.path.join(check_checkpoint(str(step.step_dir)).hf_dir, "config.json")
    assert str(other / "config.json") in error.value.message and step_config in error.value.message
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name", ["dense_tp2_dist", "dense_pp2_dist", "moe_ep2_dist"])
def test_a_use_dist_checkpointing_step_merges_from_itself(lora_steps, tmp_path, name):
    step = lora_steps[name]
    options = OutputOptions(hf_model_path=str(step.base_dir))
    with pytest.raises(AdapterError, match="--lora-alpha"):
        merge_checkpoint(str(step.step_dir), str(tmp_path / "refused"), options)
    merge_checkpoint(str(step.step_dir), str(tmp_path / "model"),
                     OutputOptions(hf_model_path=str(step.base_dir), lora_alpha=ALPHA))
    _assert_trained_model(tmp_path / "model", step)


def test_an_adapter_step_without_its_peft_export_builds_the_adapter_from_dist_ckpt(lora_steps, tmp_path):
    """No PEFT export and no base (a run whose bridge export is missing): the listing looks like a dist
    checkpoint, check reads its index and calls it megatron_lora; the merge needs --base-model and
    --lora-alpha (nothing in the step records alpha) and writes the trained model exactly."""
    step = lora_steps["dense_tp2_noexport"]
    [found] = discover(str(step.step_dir.parent.parent)).steps
    assert found.layout == "megatron_lora" and found.complete  # the names cannot tell; verl's marker can
    assert check_checkpoint(str(step.step_dir)).layout == "megatron_lora"
    with pytest.raises(AdapterError, match="--lora-alpha"):
        merge_checkpoint(str(step.step_dir), str(tmp_path / "refused"), OutputOptions(base_model=str(step.base_dir)))
    merge_checkpoint(str(step.step_dir), str(tmp_path / "model"),
                     OutputOptions(base_model=str(step.base_dir), lora_alpha=ALPHA))
    _assert_trained_model(tmp_path / "model", step)


# -------------------------------------------------------------------------------------------------
# 2. the adapter release


@pytest.mark.parametrize("name", ["dense_tp2", "llama_tp2", "moe_tp2_ep2"])
def test_the_adapter_release_is_the_runs_export_checked_against_dist_ckpt(lora_steps, tmp_path, name):
    step = lora_steps[name]
    export = step.step_dir / "model" / "huggingface" / "adapter"
    extract_lora(str(step.step_dir), str(tmp_path / "adapter"), OutputOptions(base_model=str(step.base_dir)))
    got, want = _tensors(tmp_path / "adapter"), load_file(str(export / "adapter_model.safetensors"))
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    run = json.loads((export / "adapter_config.json").read_text())
    assert {k: config[k] for k in ("r", "lora_alpha", "target_modules", "rank_pattern")} == \
        {k: run[k] for k in ("r", "lora_alpha", "target_modules", "rank_pattern")}
    assert config["base_model_name_or_path"] == "base"  # --base-model copied under base/: named relative to it


def test_an_adapter_without_its_base_names_the_base_by_a_portable_name(lora_steps, tmp_path):
    """Without base/ (``include_base`` off) the config names --base-model by its name, never this machine's path;
    with ``base_model_id``, that Hub id."""
    from merge_engine.commands.extract import ExtractJob
    from merge_engine.output.jobs import run_job

    step = lora_steps["dense_tp2"]
    options = OutputOptions(base_model=str(step.base_dir), include_base=False)
    result = run_job(ExtractJob(str(step.step_dir), str(tmp_path / "adapter"), options))
    assert result.kind == "adapter" and not (tmp_path / "adapter" / "base").exists()
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == step.base_dir.name
    run_job(ExtractJob(str(step.step_dir), str(tmp_path / "named"),
                       OutputOptions(base_model=str(step.base_dir), base_model_id="org/base")))
    assert json.loads((tmp_path / "named" / "adapter_config.json").read_text())["base_model_name_or_path"] == "org/base"


def test_an_export_that_is_not_what_was_trained_is_refused(lora_steps, tmp_path):
    copy = tmp_path / "run" / "global_step_1" / "actor"
    shutil.copytree(lora_steps["dense_tp2"].step_dir, copy)
    weights = copy / "model" / "huggingface" / "adapter" / "adapter_model.safetensors"
    tensors = load_file(str(weights))
    key = "base_model.model.model.layers.1.self_attn.k_proj.lora_B.weight"
    tensors[key] = tensors[key].clone()
    tensors[key][0, 0] += 1e-3
    save_file(tensors, str(weights))
    with pytest.raises(AdapterError, match="k_proj.lora_B.*differs"):
        extract_lora(str(copy), str(tmp_path / "adapter"), OutputOptions())
    assert not (tmp_path / "adapter").exists()


@pytest.mark.parametrize("name", ["dense_tp2_dist", "dense_pp2_dist", "moe_ep2_dist"])
def test_without_an_export_the_adapter_is_built_from_dist_ckpt_exactly(lora_steps, tmp_path, name):
    step = lora_steps[name]
    with pytest.raises(AdapterError, match="--lora-alpha"):
        extract_lora(str(step.step_dir), str(tmp_path / "refused"), OutputOptions(hf_model_path=str(step.base_dir)))
    extract_lora(str(step.step_dir), str(tmp_path / "adapter"),
                 OutputOptions(hf_model_path=str(step.base_dir), lora_alpha=ALPHA))
    got = _tensors(tmp_path / "adapter")
    assert set(got) == set(step.hf_factors)
    assert all(torch.equal(got[k], v) for k, v in step.hf_factors.items())
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["rank_pattern"]) == (step.spec.r, ALPHA, {})


# -------------------------------------------------------------------------------------------------
# 4. validation against the trained model


def _trained_model(step, folder: Path) -> torch.nn.Module:
    """The reference trained model (base + (alpha / r) B @ A from the Megatron factors, Hub names), loaded by
    transformers from a folder of its own (transformers fuses the experts itself)."""
    folder.mkdir()
    save_file(reference_fused_state(step), str(folder / "model.safetensors"))
    shutil.copy(step.base_dir / "config.json", folder / "config.json")
    return load_causal_lm(str(folder))


@pytest.mark.parametrize("name", ["dense_tp2", "llama_tp2", "moe_tp2_ep2"])
def test_peft_on_the_base_gives_the_fused_release_and_the_trained_models_logits(lora_steps, tmp_path, name):
    from peft import PeftModel

    step = lora_steps[name]
    merge_checkpoint(str(step.step_dir), str(tmp_path / "model"), OutputOptions(base_model=str(step.base_dir)))
    extract_lora(str(step.step_dir), str(tmp_path / "adapter"),
                 OutputOptions(base_model=str(step.base_dir), include_base=False))
    fused = logits(load_causal_lm(str(tmp_path / "model")))
    peft = logits(PeftModel.from_pretrained(load_causal_lm(str(step.base_dir)), str(tmp_path / "adapter")).eval())
    trained = logits(_trained_model(step, tmp_path / "trained"))
    base = logits(load_causal_lm(str(step.base_dir)))
    assert (trained - base).abs().max() > 1e-2  # the adapter changes the model
    torch.testing.assert_close(fused, trained, rtol=0, atol=0)
    torch.testing.assert_close(peft, trained, rtol=1e-5, atol=1e-5)


def test_the_adapter_release_carries_the_named_base_and_peft_loads_it_alone(lora_steps, tmp_path):
    """With include_base the base named by --base-model is copied under base/, so
    the release is self-contained: PEFT on <release>/base gives the trained model's logits."""
    from peft import PeftModel

    step = lora_steps["dense_tp2"]
    release = tmp_path / "adapter"
    extract_lora(str(step.step_dir), str(release), OutputOptions(base_model=str(step.base_dir), include_base=True))
    assert _tensors(release / "base").keys() == _tensors(step.base_dir).keys()
    peft = logits(PeftModel.from_pretrained(load_causal_lm(str(release / "base")), str(release)).eval())
    torch.testing.assert_close(peft, logits(_trained_model(step, tmp_path / "trained")), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["dense_tp2_dist", "moe_ep2_dist"])
def test_the_adapter_release_of_a_step_holding_its_base_carries_that_base_clean(lora_steps, tmp_path, name):
    """use_dist_checkpointing: base/ is the step's own base (adapter not applied: the base the run trained
    from, exactly), and PEFT loads the release alone on it and gives the fused model's logits."""
    from peft import PeftModel

    step = lora_steps[name]
    options = OutputOptions(hf_model_path=str(step.base_dir), lora_alpha=ALPHA)
    release = tmp_path / "adapter"
    extract_lora(str(step.step_dir), str(release), dataclasses.replace(options, include_base=True))
    got, want = _tensors(release / "base"), _tensors(step.base_dir)
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    merge_checkpoint(str(step.step_dir), str(tmp_path / "model"), options)
    peft = logits(PeftModel.from_pretrained(load_causal_lm(str(release / "base")), str(release)).eval())
    torch.testing.assert_close(peft, logits(load_causal_lm(str(tmp_path / "model"))), rtol=1e-5, atol=1e-5)
