"""The watcher and merge-step on verl Megatron LoRA steps (adapter only: base weights not saved).

Specification:
- without ``base_model`` the watcher does not submit such a step (every merge would raise
  BaseModelRequired): it reports "needs base_model" saying what to pass, publishes nothing, and the
  run fails; the next run does the same (no merge is attempted, nothing loops);
- a ``use_dist_checkpointing`` step (base and adapter in model/dist_ckpt, no PEFT export: discovery reads
  ckpt_contents.json) is not submitted without ``lora_alpha`` and ``hf_model_path`` ("needs ...", each run,
  nothing merged); with them its fused model is released, exactly;
- with ``base_model`` it releases the fused model (the trained weights, exactly) and the adapter
  (the run's export, base/ beside it; PEFT loads it and reproduces the fused model's logits: the manifest's
  verdict, and from outside, `PeftModel.from_pretrained` against a model holding the known fused weights).
"""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file

from flows.merge_new_steps import merge_new_steps
from flows.params import WatchParams
from merge_engine import storage
from merge_engine.release.manifest import read_manifest
from merge_engine.release.verify import verify_folder
from synthetic_runs.megatron_lora import reference_fused_state
from tests.fixtures_checkpoints import LORA_ALPHA
from tests.release_checks import assert_adapter_logits, load_model


def _run_root(lora_steps, tmp_path, name: str = "dense_tp2") -> str:
    step = lora_steps[name]
    run_root = tmp_path / "run"
    shutil.copytree(step.step_dir.parent.parent, run_root)
    return str(run_root)


def test_without_base_model_the_step_is_not_submitted_and_the_watch_says_what_to_pass(prefect, lora_steps, tmp_path):
    run_root = _run_root(lora_steps, tmp_path)
    params = WatchParams(run_root=run_root, staging_root=str(tmp_path / "staging"))
    for _ in range(2):  # a second run does the same: nothing merged, nothing looping
        with pytest.raises(RuntimeError, match="base weights not saved.*pass base_model"):
            merge_new_steps(**params.flow_parameters())
    assert not storage.list_files(params.release_root_url, recursive=True)


def test_with_base_model_the_fused_model_and_the_adapter_are_released(prefect, lora_steps, tmp_path):
    step = lora_steps["dense_tp2"]
    run_root = _run_root(lora_steps, tmp_path)
    params = WatchParams(run_root=run_root, staging_root=str(tmp_path / "staging"), base_model=str(step.base_dir))
    (outcome,) = merge_new_steps(**params.flow_parameters()).outcomes
    kinds = {r.kind: r.url for r in outcome.releases}
    assert set(kinds) == {"model", "adapter"}
    assert verify_folder(kinds["model"]).ok and verify_folder(kinds["adapter"]).ok
    want = reference_fused_state(step)
    got = load_file(storage.join(kinds["model"], "model.safetensors"))
    assert set(got) == set(want) and all(torch.equal(got[k], v) for k, v in want.items())
    checks = {c["name"]: c for c in read_manifest(kinds["adapter"]).validation["checks"]}
    assert checks["peft_load"]["ok"] and checks["peft_logits"]["ok"]
    # from outside: PEFT loads the adapter onto its base/ and gives the logits of the known fused weights
    trained = load_model(str(step.base_dir))
    trained.load_state_dict(want, strict=not trained.config.tie_word_embeddings)
    assert_adapter_logits(kinds["adapter"], trained)


def test_a_use_dist_checkpointing_step_waits_for_lora_alpha_then_releases_the_trained_model(prefect, lora_steps,
                                                                                           tmp_path):
    step = lora_steps["dense_tp2_dist"]
    run_root = _run_root(lora_steps, tmp_path, "dense_tp2_dist")
    params = WatchParams(run_root=run_root, staging_root=str(tmp_path / "staging"))
    for _ in range(2):  # not submitted (a merge would fail without alpha), the same answer each run
        with pytest.raises(RuntimeError, match="not submitted.*pass lora_alpha.*pass hf_model_path"):
            merge_new_steps(**params.flow_parameters())
    assert not storage.list_files(params.release_root_url, recursive=True)
    params = WatchParams(run_root=run_root, staging_root=str(tmp_path / "staging"), lora_alpha=LORA_ALPHA,
                         hf_model_path=str(step.base_dir))
    (outcome,) = merge_new_steps(**params.flow_parameters()).outcomes
    kinds = {r.kind: r.url for r in outcome.releases}
    want = reference_fused_state(step)
    got = load_file(storage.join(kinds["model"], "model.safetensors"))
    assert set(got) == set(want) and all(torch.equal(got[k], v) for k, v in want.items())
