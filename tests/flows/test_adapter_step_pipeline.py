"""The watcher on an adapter-only step of HF Trainer (its ZeRO-2 save of a PEFT model: the adapter's fp32 masters,
PEFT's adapter files beside, no config, no base weight; written by real DeepSpeed) given ``base_model``: it releases
the fused model, PEFT's ``merge_and_unload`` in fp32 tensor for tensor, and the adapter, both verified."""

from __future__ import annotations

import copy
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file

from flows.merge_new_steps import merge_new_steps
from flows.params import WatchParams
from merge_engine import storage
from merge_engine.release.verify import verify_folder


def test_with_base_model_hf_trainers_adapter_only_step_releases_the_fused_model(prefect, zero_lora_runs, tmp_path):
    run = zero_lora_runs["lora_zero2_hf_trainer"]
    run_root = tmp_path / "run"
    shutil.copytree(Path(run.step_dir(1)).parent, run_root)
    base_dir = str(tmp_path / "base")
    run.base_model(1).eval().save_pretrained(base_dir)
    params = WatchParams(run_root=str(run_root), staging_root=str(tmp_path / "staging"), base_model=base_dir)
    (outcome,) = merge_new_steps(**params.flow_parameters()).outcomes
    kinds = {r.kind: r.url for r in outcome.releases}
    assert set(kinds) == {"model", "adapter"}
    assert verify_folder(kinds["model"]).ok and verify_folder(kinds["adapter"]).ok
    want = copy.deepcopy(run.trained_model(1)).float().merge_and_unload().state_dict()
    got = load_file(storage.join(kinds["model"], "model.safetensors"))
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], v) for k, v in want.items())
