"""``merge --base-model`` of an adapter-only LoRA step: the step's adapter fused into the base the user names.

The three adapter-only saves (verl's ``save_lora_only`` rank files: only the LoRA keys in every FSDP2 rank file; HF
Trainer's DCP ``adapter_only`` save through Accelerate; HF Trainer's ZeRO-2 save of a PEFT model, the adapter's fp32
masters only, written by real DeepSpeed) merge with ``--base-model`` into exactly the weights PEFT's own
``merge_and_unload`` gives in fp32, tensor for tensor; without ``--base-model`` each is still refused, nothing
written; a base of another shape is refused by name, nothing written.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from merge_engine.cli import main
from tests.merge_engine.lora.test_trainer_loras import _save_base, _weights, runs  # noqa: F401 - the fixture


def _assert_pefts_merge(out: Path, trained: torch.nn.Module) -> None:
    expected = copy.deepcopy(trained).float().merge_and_unload().state_dict()
    merged = _weights(out)
    assert sorted(merged) == sorted(expected)
    for key, value in expected.items():
        assert merged[key].dtype == torch.float32 and torch.equal(merged[key], value), key


@pytest.mark.parametrize("name", ["dcp_adapter", "lora_zero2_hf_trainer"])
def test_hf_trainers_adapter_only_step_fuses_into_the_base_bit_for_bit(runs, tmp_path, name):  # noqa: F811
    run = runs(name)
    base_dir = _save_base(run, tmp_path / "base")
    alpha = ["--lora-alpha", "8"] if name.startswith("dcp_") else []  # HF Trainer's ZeRO save has PEFT's config
    refused = tmp_path / "refused"
    assert main(["merge", "--local_dir", run.folder, "--target_dir", str(refused), *alpha]) != 0
    assert not refused.exists()
    out = tmp_path / "fused"
    assert main(["merge", "--local_dir", run.folder, "--target_dir", str(out), "--base-model", base_dir, *alpha]) == 0
    _assert_pefts_merge(out, run.trained)
    recorded = json.load(open(out / "stepmerge.json"))
    assert recorded["base_model"].endswith("base") and recorded["lora"]["lora_alpha"] == 8
    assert json.load(open(out / "config.json"))["model_type"] == "qwen2"


def test_verls_lora_only_save_fuses_into_the_base_bit_for_bit(lora_only_checkpoint, tmp_path):
    run = lora_only_checkpoint
    base_dir = str(tmp_path / "base")
    run.base_model().float().save_pretrained(base_dir)
    out = tmp_path / "fused"
    assert main(["merge", "--local_dir", run.checkpoint_dir, "--target_dir", str(out), "--base-model", base_dir]) == 0
    _assert_pefts_merge(out, run.trained_model())


def test_a_base_of_another_model_is_refused_nothing_written(runs, tmp_path, gpt2_base):  # noqa: F811
    run = runs("dcp_adapter")
    out = tmp_path / "fused"
    code = main(["merge", "--local_dir", run.folder, "--target_dir", str(out), "--base-model", gpt2_base,
                 "--lora-alpha", "8"])
    assert code != 0 and not out.exists()
