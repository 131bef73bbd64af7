"""Validation against the trained model (`merge_engine.validate.trained.check_against_trained`).

Checkpoints: verl's default LoRA (``target_modules: all-linear``, r 4, lora_alpha 16: alpha != 2r, so
a wrong scale shows) on transformers-5 Mixtral and Qwen3-MoE, the session's `verl_lora_runs` (FSDP2,
world 2, ``lora_train_meta.json`` with only r / lora_alpha / task_type).
PEFT turns all-linear into LoRA on the fused experts with ``rank_pattern`` 2r AND ``alpha_pattern``
2 alpha on ``gate_up_proj``. Specification:
- the check rebuilds PEFT's model of the run (all-linear, PEFT's own patterns) from the checkpoint's
  un-merged tensors, strictly, and a fused model / adapter that IS that model passes (PEFT's own
  ``merge_and_unload`` and ``save_pretrained``);
- a fused model whose expert gate/up update is halved (today's scale bug, built from PEFT's merge)
  FAILS ``trained_vs_fused``, naming the largest logit difference, the tensor and ``0.50x``;
- an adapter whose expert gate/up B is halved fails ``trained_vs_adapter``;
- run metadata that no PEFT model fits (the recorded r is not the tensors') fails ``trained_model``;
- over the memory budget, or with a LoRA-only checkpoint, every check is reported SKIPPED (never passed
  silently); a skipped check shows as SKIP in the summary and survives the report's round trip;
- stepmerge's own merge and extract-lora of these checkpoints reproduce the trained model (issue 16 item 1).
"""

from __future__ import annotations

import copy
import json
import os
import shutil

import pytest
import torch

from merge_engine.validate import ValidationReport
from merge_engine.validate.trained import MAX_BYTES_ENV, TRAINED, VS_ADAPTER, VS_FUSED, check_against_trained

FAMILIES = ["mixtral", "qwen3_moe"]  # PEFT fuses gate/up with rank_pattern 2r and alpha_pattern 2 alpha
GATE_UP = "mlp.experts.gate_up_proj"


class VerlDefaultRun:
    """A verl-default LoRA checkpoint of the session's `verl_lora_runs` (FSDP2, world 2) and PEFT's trained
    model of it (`synthetic_runs.fsdp.build_reference_model`: PEFT's own ``get_peft_model``)."""

    def __init__(self, run, root) -> None:
        from synthetic_runs.fsdp import build_reference_model

        self.spec, self.seed = run.spec, run.latest.seed
        self.checkpoint = run.latest.checkpoint_dir
        self.model = build_reference_model(self.spec, self.seed).eval()
        self.root = root

    def base_model(self):
        from synthetic_runs.models import build_model, torch_dtype

        return build_model(self.spec.model, self.seed, torch_dtype(self.spec.dtype)).eval()

    def fused_folder(self, name: str, gate_up_factor: float = 1.0) -> str:
        """PEFT's merged trained model, saved by transformers; ``gate_up_factor`` scales every expert
        gate/up update (0.5: today's bug)."""
        base = self.base_model().state_dict()
        merged = copy.deepcopy(self.model).merge_and_unload()
        with torch.no_grad():
            for key, param in merged.state_dict().items():
                if key.endswith(GATE_UP):
                    param.copy_(base[key] + gate_up_factor * (param - base[key]))
        folder = str(self.root / name)
        merged.save_pretrained(folder)
        return folder

    def adapter_folder(self, name: str, gate_up_b_factor: float = 1.0) -> str:
        """PEFT's ``save_pretrained`` of the adapter, with the base model under base/."""
        from safetensors.torch import load_file, save_file

        folder = str(self.root / name)
        self.model.save_pretrained(folder)
        self.base_model().save_pretrained(os.path.join(folder, "base"))
        if gate_up_b_factor != 1.0:
            path = os.path.join(folder, "adapter_model.safetensors")
            tensors = load_file(path)
            hits = [k for k in tensors if "lora_B" in k and ("experts.base_layer" in k or "w1" in k or "w3" in k
                                                            or "gate_proj" in k or "up_proj" in k) and "shared" not in k]
            assert hits, sorted(tensors)
            save_file({k: (v * gate_up_b_factor if k in hits else v).contiguous() for k, v in tensors.items()}, path)
        return folder


@pytest.fixture(scope="module")
def runs(verl_lora_runs, tmp_path_factory) -> dict[str, VerlDefaultRun]:
    return {family: VerlDefaultRun(verl_lora_runs[f"{family}_verl_lora_w2"], tmp_path_factory.mktemp(f"trained_{family}"))
            for family in FAMILIES}


def _check(report: ValidationReport, name: str):
    found = report.check(name)
    assert found is not None, report.summary()
    return found


@pytest.mark.parametrize("family", FAMILIES)
def test_peft_own_merge_and_adapter_are_the_trained_model(runs, family):
    run = runs[family]
    report = check_against_trained(run.checkpoint, fused_model_url=run.fused_folder("peft-merged"),
                                   adapter_url=run.adapter_folder("peft-adapter"))
    assert report.ok, report.summary()
    trained = _check(report, TRAINED).detail
    assert "'all-linear'" in trained and "gate_up_proj" in trained and "32" in trained  # PEFT's 2 alpha
    assert "equal within" in _check(report, VS_FUSED).detail
    assert not any(c.skipped for c in report.checks)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_halved_expert_gate_up_update_fails_by_name(runs, family):
    """Today's bug on main: gate/up scaled alpha / 2r instead of 2 alpha / 2r. Structure and forward pass
    would pass; the trained model does not."""
    run = runs[family]
    report = check_against_trained(run.checkpoint, fused_model_url=run.fused_folder("halved", gate_up_factor=0.5))
    assert not report.ok
    failed = _check(report, VS_FUSED)
    assert not failed.ok
    assert "largest logit difference" in failed.detail
    assert f"{GATE_UP} " in failed.detail and "0.50x the trained update" in failed.detail, failed.detail
    with pytest.raises(Exception, match=VS_FUSED):
        report.raise_for_failure()


@pytest.mark.parametrize("family", FAMILIES)
def test_an_adapter_with_halved_expert_gate_up_fails(runs, family):
    run = runs[family]
    report = check_against_trained(run.checkpoint, adapter_url=run.adapter_folder("halved-adapter", 0.5))
    failed = _check(report, VS_ADAPTER)
    assert not failed.ok and "largest logit difference" in failed.detail, failed.detail


def test_metadata_no_peft_model_fits_fails_named(runs, tmp_path):
    run = runs["mixtral"]
    checkpoint = shutil.copytree(run.checkpoint, tmp_path / "actor")
    (checkpoint / "lora_train_meta.json").write_text(json.dumps({"r": 8, "lora_alpha": 16}))
    report = check_against_trained(str(checkpoint), fused_model_url=run.fused_folder("peft-merged-2"))
    failed = _check(report, TRAINED)
    assert not failed.ok and "no PEFT model of the run's settings" in failed.detail, failed.detail


def test_a_model_over_the_memory_budget_is_skipped_not_passed(runs, monkeypatch):
    run = runs["qwen3_moe"]
    monkeypatch.setenv(MAX_BYTES_ENV, "1000")
    report = check_against_trained(run.checkpoint, fused_model_url=run.fused_folder("halved-skip", 0.5))
    assert [c.name for c in report.checks] == [TRAINED, VS_FUSED]
    assert all(c.skipped and c.ok for c in report.checks)
    assert "over this worker's budget" in report.checks[0].detail
    assert "- SKIP `trained_vs_fused`" in report.summary() and "2 skipped" in report.summary()
    again = ValidationReport.from_dict(report.to_dict())
    assert all(c.skipped for c in again.checks)


def test_a_lora_only_checkpoint_is_skipped_with_its_reason(runs, tmp_path):
    run = runs["qwen3_moe"]
    checkpoint = tmp_path / "actor"
    shutil.copytree(run.checkpoint, checkpoint)
    import torch.distributed.tensor  # noqa: F401 - DTensor must be importable to load these files

    for rank_file in checkpoint.glob("model_world_size_*_rank_*.pt"):
        state = torch.load(rank_file, weights_only=True)
        torch.save({k: v for k, v in state.items() if ".lora_" in k}, rank_file)
    report = check_against_trained(str(checkpoint), adapter_url=run.adapter_folder("adapter-lora-only"))
    assert all(c.skipped for c in report.checks) and "only LoRA factors" in report.checks[0].detail


@pytest.mark.parametrize("family", FAMILIES)
def test_stepmerge_merge_and_extract_reproduce_the_trained_model(runs, family, tmp_path):
    """Issue 16 item 1 (per-module scale as PEFT trained it): stepmerge's outputs pass the check."""
    from merge_engine.commands.extract import extract_lora
    from merge_engine.output.jobs import OutputOptions
    from merge_engine.commands.merge import merge_checkpoint
    from merge_engine.output.jobs import OutputOptions

    run = runs[family]
    merge_checkpoint(run.checkpoint, str(tmp_path / "fused"), OutputOptions())
    extract_lora(run.checkpoint, str(tmp_path / "adapter"), OutputOptions())
    report = check_against_trained(run.checkpoint, fused_model_url=str(tmp_path / "fused"),
                                   adapter_url=str(tmp_path / "adapter"))
    assert report.ok, report.summary()


def test_the_cli_check_fails_with_exit_5_naming_the_check(runs, capsys):
    """``stepmerge check-trained``: PEFT's own merge passes (exit 0); the halved one exits 5 with the named
    failure on stderr and the report on stdout."""
    from merge_engine.cli import main

    run = runs["mixtral"]
    assert main(["check-trained", "--local_dir", run.checkpoint, "--fused-model", run.fused_folder("cli-ok")]) == 0
    assert "PASS trained_vs_fused" in capsys.readouterr().out
    code = main(["check-trained", "--local_dir", run.checkpoint, "--fused-model", run.fused_folder("cli-bad", 0.5)])
    out, err = capsys.readouterr()
    assert code == 5 and "ValidationFailed" in err and "trained_vs_fused" in err
    assert "0.50x the trained update" in out


def test_merge_with_check_trained_checks_the_written_folder(runs, tmp_path, capsys):
    """``stepmerge merge --check-trained`` of a verl-default Qwen3-MoE LoRA: the merged folder is checked
    against the trained model after writing, and passes (each module's scale as PEFT trained it)."""
    from merge_engine.cli import main

    run = runs["qwen3_moe"]
    code = main(["merge", "--local_dir", run.checkpoint, "--target_dir", str(tmp_path / "out"), "--check-trained"])
    out = capsys.readouterr().out
    assert code == 0 and "PASS trained_vs_fused" in out and "PASS trained_model" in out, out
