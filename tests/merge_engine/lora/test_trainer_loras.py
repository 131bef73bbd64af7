"""LoRA runs of the trainers beside verl, saved by their own libraries (the session's ``dcp_lora_runs`` and
``zero_lora_runs``: a tiny Qwen2 wrapped by ``peft.get_peft_model``, LoRA r=4, alpha=8 on q/v, factors non-zero).

- Accelerate's DCP save of the whole PEFT model (``checkpoint-1/pytorch_model_fsdp_0/``) and a bare DeepSpeed
  engine's ZeRO-2 save (the frozen base in the model states file, the factors' fp32 masters in the optim
  partitions) ``merge`` into exactly the weights PEFT's own ``merge_and_unload`` gives in fp32, and
  ``extract-lora`` into an adapter that ``PeftModel.from_pretrained`` loads onto the clean base (the base model bit
  for bit) with the trained model's logits;
- ``lora_alpha`` comes from PEFT's ``adapter_config.json`` saved beside the checkpoint, else ``--lora-alpha``: it is
  never guessed (refused, nothing written);
- HF Trainer's adapter-only saves (Accelerate's ``adapter_only=True``; DeepSpeed's ``exclude_frozen_parameters``
  beside PEFT's own adapter files) extract against ``--base-model`` (alpha from the adapter config HF Trainer
  saved); a plain ``merge`` of one is refused by name (it holds no base), nothing written; discovery says such a
  DeepSpeed step needs ``base_model`` (the model the run trained from), not ``hf_model_path``.
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from merge_engine.cli import main
from merge_engine.layouts import check_checkpoint
from merge_engine.layouts.discovery import discover
from tests.merge_engine.lora.conftest import logits, peft_logits
from tests.merge_engine.lora.test_fuse import ATOL, RTOL

FUSED = ("dcp_full", "zero2_fp32")
ZERO = {"zero2_fp32": "lora_zero2_fp32"}


class Run:
    """One LoRA step: the folder a command is given, the config folder it needs (None: saved with it), the trained
    PEFT model (fp32) and its base."""

    def __init__(self, folder: str, hf: str | None, trained: torch.nn.Module, base: torch.nn.Module) -> None:
        self.folder, self.hf, self.trained, self.base = folder, hf, trained.eval(), base.eval()

    def args(self, command: str, target: Path, *extra: str) -> list[str]:
        target_flag = "--target_dir" if command == "merge" else "--target-dir"
        config = ["--hf_model_path", self.hf] if self.hf else []
        return [command, "--local_dir", self.folder, target_flag, str(target), *config, *extra]


def _dcp_run(dcp_lora_runs, name: str) -> Run:
    from synthetic_runs.fsdp import build_reference_model
    from synthetic_runs.models import build_model

    step = dcp_lora_runs[name]
    hf = str(Path(step.step_dir).parents[2] / "hf")
    return Run(step.step_dir, hf, build_reference_model(step.spec, step.seed),
               build_model(step.spec.model, step.seed, torch.float32))


def _zero_run(zero_lora_runs, name: str) -> Run:
    run = zero_lora_runs[name]
    return Run(run.step_dir(1), run.hf_config_dir if run.spec.trainer == "deepspeed" else None,
               run.trained_model(1), run.base_model(1))


@pytest.fixture
def runs(request):
    """name -> Run, building only the fixture that name needs (the DCP and the DeepSpeed runs are separate)."""
    def get(name: str) -> Run:
        if name.startswith("dcp_"):
            return _dcp_run(request.getfixturevalue("dcp_lora_runs"), name[len("dcp_"):])
        return _zero_run(request.getfixturevalue("zero_lora_runs"), ZERO.get(name, name))
    return get


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for path in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(path)))
    return out


def _save_base(run: Run, folder: Path) -> str:
    run.base.save_pretrained(str(folder))
    return str(folder)


@pytest.mark.parametrize("name", FUSED)
def test_merge_is_pefts_merge_and_unload_bit_for_bit(runs, tmp_path, name):
    run = runs(name)
    checkpoint = check_checkpoint(run.folder)
    assert checkpoint.lora is True
    out = tmp_path / "fused"
    assert main(run.args("merge", out, "--lora-alpha", "8")) == 0
    expected = copy.deepcopy(run.trained).merge_and_unload().state_dict()
    merged = _weights(out)
    assert sorted(merged) == sorted(expected)
    for key, value in expected.items():
        assert merged[key].dtype == torch.float32 and torch.equal(merged[key], value), key
    assert json.load(open(out / "stepmerge.json"))["lora"]["lora_alpha_from"] == "--lora-alpha"


@pytest.mark.parametrize("name", ("dcp_full", "zero2_fp32"))
def test_lora_alpha_is_never_guessed(runs, tmp_path, name):
    run = runs(name)
    out = tmp_path / "fused"
    assert main(run.args("merge", out)) != 0
    assert not out.exists()


@pytest.mark.parametrize("name", FUSED)
def test_extracted_adapter_loads_in_peft_with_the_trained_logits(runs, tmp_path, name):
    run = runs(name)
    out = tmp_path / "adapter"
    assert main(run.args("extract-lora", out, "--lora-alpha", "8")) == 0
    config = json.load(open(out / "adapter_config.json"))
    assert (config["r"], config["lora_alpha"], sorted(config["target_modules"])) == (4, 8, ["q_proj", "v_proj"])
    base = load_file(str(out / "base" / "model.safetensors"))
    expected = run.base.state_dict()
    assert sorted(base) == sorted(expected) and all(torch.equal(base[k], expected[k]) for k in base)
    trained = logits(run.trained)
    torch.testing.assert_close(peft_logits(str(out / "base"), str(out)), trained, atol=ATOL, rtol=RTOL)
    assert float((trained - logits(run.base)).abs().max()) > 0.05  # the LoRA changes the model: not a vacuous test


def test_a_peft_adapter_config_beside_a_dcp_checkpoint_is_the_runs_lora_config(runs, tmp_path):
    """PEFT's own adapter_config.json beside ``pytorch_model_fsdp_0/`` (no config.json there) gives alpha: it is in
    the checkpoint's listing, so the fingerprint covers it."""
    import peft

    run = runs("dcp_full")
    folder = tmp_path / "checkpoint-1"
    shutil.copytree(run.folder, folder)
    peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM") \
        .save_pretrained(str(folder))
    assert "adapter_config.json" in {f.path for f in check_checkpoint(str(folder)).files}
    out = tmp_path / "fused"
    assert main(["merge", "--local_dir", str(folder), "--target_dir", str(out), "--hf_model_path", run.hf]) == 0
    recorded = json.load(open(out / "stepmerge.json"))["lora"]
    assert recorded["lora_alpha"] == 8 and recorded["lora_alpha_from"].endswith("checkpoint-1/adapter_config.json")
    expected = copy.deepcopy(run.trained).merge_and_unload().state_dict()
    merged = _weights(out)
    assert all(torch.equal(merged[key], value) for key, value in expected.items())


def test_hf_trainers_adapter_only_dcp_save_extracts_against_the_base(runs, tmp_path):
    """HF Trainer saves a PEFT model's adapter only (``lora_A.weight``, no base, no alpha anywhere): extract-lora
    writes the adapter and, under base/, the --base-model it was checked against, so PEFT loads the release alone."""
    run = runs("dcp_adapter")
    checkpoint = check_checkpoint(run.folder)
    assert checkpoint.lora is True
    base_dir = _save_base(run, tmp_path / "base")
    merged = tmp_path / "fused"
    assert main(run.args("merge", merged, "--lora-alpha", "8")) != 0 and not merged.exists()  # no base in it
    out = tmp_path / "adapter"
    assert main(run.args("extract-lora", out, "--base-model", base_dir, "--lora-alpha", "8")) == 0
    assert json.load(open(out / "adapter_config.json"))["base_model_name_or_path"] == "base"  # written beside it
    written, given = load_file(str(out / "base" / "model.safetensors")), load_file(f"{base_dir}/model.safetensors")
    assert written.keys() == given.keys() and all(torch.equal(written[k], given[k]) for k in given)
    torch.testing.assert_close(peft_logits(str(out / "base"), str(out)), logits(run.trained), atol=ATOL, rtol=RTOL)


def test_hf_trainers_deepspeed_save_of_a_peft_model(runs, zero_lora_runs, tmp_path):
    """ZeRO-2 in bf16 inside HF Trainer's ``checkpoint-1/``: the adapter's fp32 masters only
    (``exclude_frozen_parameters``), PEFT's adapter_config.json and adapter_model.safetensors beside. The adapter is
    extracted with alpha from that config (no --lora-alpha), equal to HF Trainer's own adapter file, and loads in
    PEFT onto the base with the trained logits; a plain merge is refused (no base), nothing written."""
    run = runs("lora_zero2_hf_trainer")
    folder = Path(run.folder)
    assert (folder / "adapter_config.json").exists() and not (folder / "config.json").exists()
    assert check_checkpoint(run.folder).lora is True
    (step,) = discover(str(folder.parent)).steps  # what the watcher is told the merge needs: the base
    assert (step.status, step.needs) == ("complete", ("base_model",))
    assert "base_model (--base-model)" in step.reason and "hf_model_path" not in step.reason
    base_dir = _save_base(run, tmp_path / "base")
    merged = tmp_path / "fused"
    assert main(["merge", "--local_dir", run.folder, "--target_dir", str(merged), "--hf_model_path", base_dir]) != 0
    assert not merged.exists()
    out = tmp_path / "adapter"
    assert main(["extract-lora", "--local_dir", run.folder, "--target-dir", str(out), "--base-model", base_dir]) == 0
    recorded = json.load(open(out / "stepmerge.json"))
    assert json.load(open(out / "adapter_config.json"))["lora_alpha"] == 8
    assert "adapter_config.json" in json.dumps(recorded)  # where alpha came from
    ours, theirs = load_file(str(out / "adapter_model.safetensors")), load_file(str(folder / "adapter_model.safetensors"))
    assert sorted(ours) == sorted(theirs)
    assert all(torch.equal(ours[k].to(theirs[k].dtype), theirs[k]) for k in ours)
    torch.testing.assert_close(peft_logits(base_dir, str(out)), logits(run.trained), atol=ATOL, rtol=RTOL)
    assert json.load(open(out / "adapter_config.json"))["base_model_name_or_path"] == "base"  # --base-model under base/
    torch.testing.assert_close(peft_logits(str(out / "base"), str(out)), logits(run.trained), atol=ATOL, rtol=RTOL)
