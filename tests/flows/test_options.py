"""The options of the flows (what the UI form exposes), end to end on real checkpoints.

- ``lora_alpha`` reaches the merge of a LoRA step whose run recorded no alpha (the trained model
  needs it as much as the adapter); without it the step fails with a named error, publishing nothing;
- ``dtype="bfloat16"`` on a LoRA step: model and adapter are released in bfloat16 and the adapter
  passes its validation against the bfloat16 model (rounding is allowed for, not a wrong adapter);
- ``release_adapter=False``: the model only, and the watcher does not want more;
- ``roles`` and ``max_steps`` choose what the watcher merges;
- ``overwrite``: a step rewritten after its release is reported by the watcher; without overwrite a
  merge_step fails at once (before merging anything: no staging left); with it the release is
  replaced and records the new listing;
- ``hf_model_path``: a changed folder content (same URL) is a new merge, not a cache hit;
- ``reference_url``: values and logits compared; a different model fails validation, publishes nothing
  (the reference, an earlier release, and the release compared with it are both judged from outside
  stepmerge first: each holds the step's own weights, `tests.release_checks`);
- ``weights_format="transformers"`` on a MoE run (Mixtral, FSDP2): the release holds the stored, fused
  expert tensors, records the format, and passes validation against those names (the default ``hub``
  release of the same step holds the per-expert Hub names).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import tasks.build
from flows.merge_new_steps import merge_new_steps
from flows.merge_step import merge_step
from flows.params import MergeStepParams, WatchParams
from merge_engine import storage
from merge_engine.errors import AdapterError, TargetExists, ValidationFailed
from merge_engine.release.manifest import is_released, read_manifest
from merge_engine.release.folders import release_url
from merge_engine.release.verify import verify_folder
from tests.fixtures_pipeline import LORA_STEP, ROLE, copy_steps
from tests.release_checks import (
    assert_adapter_logits,
    assert_release_of_step,
    assert_release_weights_equal,
)

BF16_LOGITS_RTOL = 2e-2  # an adapter and base in bfloat16 against PEFT's float32 model of the run


def _params(run_root: str, tmp_path: Path, step: int, **options) -> MergeStepParams:
    return MergeStepParams(run_root=run_root, step=step, staging_root=str(tmp_path / "staging"), **options)


def _checks(release: str) -> dict:
    return {c["name"]: c for c in read_manifest(release).validation["checks"]}


def _dtypes(folder: str) -> set[str]:
    with safe_open(str(Path(folder) / "model.safetensors"), "pt") as weights:
        return {str(weights.get_slice(name).get_dtype()) for name in weights.keys()}


def test_lora_alpha_reaches_the_merge_when_the_run_did_not_record_it(prefect, template_run, tmp_path):
    run_root = str(tmp_path / "run")
    copy_steps(template_run, run_root, [LORA_STEP], omit=[f"global_step_{LORA_STEP}/{ROLE}/lora_train_meta.json"])
    unknown = merge_step(**_params(run_root, tmp_path, LORA_STEP).flow_parameters(), return_state=True)
    with pytest.raises(AdapterError):
        unknown.result()
    assert not storage.list_files(str(tmp_path / "run" / "releases"))

    outcome = merge_step(**_params(run_root, tmp_path, LORA_STEP, lora_alpha=8).flow_parameters())
    kinds = {r.kind: r for r in outcome.releases}
    assert outcome.status == "published" and set(kinds) == {"model", "adapter"}
    assert read_manifest(kinds["model"].url).options["lora_alpha"] == 8
    config = json.loads(storage.read_text(storage.join(kinds["adapter"].url, "adapter_config.json")))
    assert config["lora_alpha"] == 8
    assert _checks(kinds["adapter"].url)["peft_logits"]["ok"]  # fused with the same alpha
    trained = template_run.trained_model(LORA_STEP)  # from outside: PEFT's model of the run, alpha 8
    assert_release_of_step(kinds["model"].url, template_run, LORA_STEP)
    assert_adapter_logits(kinds["adapter"].url, trained)


def test_a_bfloat16_release_of_a_lora_step_passes_adapter_validation(prefect, template_run, tmp_path):
    run_root = str(tmp_path / "run")
    copy_steps(template_run, run_root, [LORA_STEP])
    outcome = merge_step(**_params(run_root, tmp_path, LORA_STEP, dtype="bfloat16").flow_parameters())
    kinds = {r.kind: r for r in outcome.releases}
    assert outcome.status == "published" and all(r.validation_ok for r in outcome.releases)
    assert _dtypes(kinds["model"].url) == {"BF16"}
    assert verify_folder(kinds["adapter"].url).ok
    logits = _checks(kinds["adapter"].url)["peft_logits"]
    assert logits["ok"] and "bfloat16" in logits["detail"]
    # from outside: the model is PEFT's merge_and_unload cast to bfloat16 by torch; the adapter gives PEFT's
    # logits of the run within bfloat16's rounding
    reference = {k: v.to(torch.bfloat16) for k, v in template_run.reference_weights(LORA_STEP).items()}
    assert_release_weights_equal(kinds["model"].url, reference)
    assert_adapter_logits(kinds["adapter"].url, template_run.trained_model(LORA_STEP), rtol=BF16_LOGITS_RTOL)


def test_release_adapter_false_releases_the_model_only(prefect, template_run, tmp_path):
    run_root = str(tmp_path / "run")
    copy_steps(template_run, run_root, [LORA_STEP])
    watch = WatchParams(run_root=run_root, staging_root=str(tmp_path / "staging"), release_adapter=False)
    (outcome,) = merge_new_steps(**watch.flow_parameters()).outcomes
    assert [r.kind for r in outcome.releases] == ["model"]
    assert not storage.list_files(release_url(str(tmp_path / "run" / "releases"), ROLE, LORA_STEP, "adapter"))
    assert merge_new_steps(**watch.flow_parameters()).actions == []


def test_roles_and_max_steps_choose_what_the_watcher_merges(prefect, template_run, tmp_path):
    run_root = tmp_path / "run"
    copy_steps(template_run, str(run_root), [1, 2])
    shutil.copytree(run_root / "global_step_1" / ROLE, run_root / "global_step_1" / "critic")
    staging = str(tmp_path / "staging")

    critic = merge_new_steps(**WatchParams(run_root=str(run_root), staging_root=staging, roles=["critic"]).flow_parameters())
    assert [(a.step, a.role, a.action) for a in critic.actions] == [(1, "critic", "merged")]
    assert is_released(release_url(str(run_root / "releases"), "critic", 1))

    first = merge_new_steps(**WatchParams(run_root=str(run_root), staging_root=staging, max_steps=1).flow_parameters())
    assert [(a.step, a.role) for a in first.actions] == [(1, ROLE)]  # the oldest first, one per tick
    second = merge_new_steps(**WatchParams(run_root=str(run_root), staging_root=staging, max_steps=1).flow_parameters())
    assert [(a.step, a.role) for a in second.actions] == [(2, ROLE)]


def _rewrite_step(template_run, run_root: Path, step: int, from_step: int) -> None:
    """The files of ``from_step`` saved again as ``step`` (a re-run of training that overwrote it)."""
    for path in template_run.files(from_step):
        target = run_root / f"global_step_{step}" / path.relative_to(template_run.step_dir(from_step))
        shutil.copyfile(path, target)


def test_a_rewritten_step_fails_fast_without_overwrite_and_is_replaced_with_it(prefect, template_run, tmp_path,
                                                                               monkeypatch):
    run_root = tmp_path / "run"
    copy_steps(template_run, str(run_root), [1])
    first = merge_step(**_params(str(run_root), tmp_path, 1).flow_parameters())
    release = first.releases[0].url
    _rewrite_step(template_run, run_root, 1, from_step=2)

    watch = WatchParams(run_root=str(run_root), staging_root=str(tmp_path / "staging"))
    assert [(a.step, a.action) for a in merge_new_steps(**watch.flow_parameters()).actions] == [(1, "changed since release")]

    merged = []
    real_run = tasks.build.run_job
    monkeypatch.setattr(tasks.build, "run_job", lambda job, **k: merged.append(job) or real_run(job, **k))
    refused = merge_step(**_params(str(run_root), tmp_path, 1).flow_parameters(), return_state=True)
    with pytest.raises(TargetExists):
        refused.result()
    assert merged == []  # refused before merging: nothing read, nothing staged
    assert not storage.list_files(str(tmp_path / "staging"))
    assert read_manifest(release).fingerprint == first.releases[0].fingerprint  # the old release stands

    replaced = merge_step(**_params(str(run_root), tmp_path, 1, overwrite=True).flow_parameters())
    assert replaced.status == "published" and len(merged) == 1
    manifest = read_manifest(release)
    assert manifest.fingerprint != first.releases[0].fingerprint and verify_folder(release).ok
    assert_release_of_step(release, template_run, 2)  # the rewritten step's weights (step 2's), judged from outside
    assert merge_new_steps(**watch.flow_parameters()).actions == []  # the release now records the new listing


def test_a_changed_hf_model_path_is_a_new_merge_not_a_cache_hit(prefect, template_run, tmp_path):
    run_root = str(tmp_path / "run")
    copy_steps(template_run, run_root, [1])
    metadata = tmp_path / "hf"
    shutil.copytree(template_run.step_dir(1) / ROLE / "huggingface", metadata)
    first = merge_step(**_params(run_root, tmp_path, 1, hf_model_path=str(metadata)).flow_parameters())
    assert first.status == "published"

    config = json.loads((metadata / "config.json").read_text())
    (metadata / "config.json").write_text(json.dumps({**config, "stepmerge_test_note": "edited"}))
    again = merge_step(**_params(run_root, tmp_path, 1, hf_model_path=str(metadata), overwrite=True).flow_parameters())
    assert again.status == "published" and not again.cached
    released = json.loads(storage.read_text(storage.join(again.releases[0].url, "config.json")))
    assert released["stepmerge_test_note"] == "edited"


def test_reference_url_compares_values_and_a_different_model_fails(prefect, template_run, tmp_path):
    run_root = str(tmp_path / "run")
    copy_steps(template_run, run_root, [1, 2])
    reference = merge_step(**_params(run_root, tmp_path, 1, release_root=str(tmp_path / "first")).flow_parameters()).releases[0].url
    assert_release_of_step(reference, template_run, 1)  # the reference is the step's model, judged from outside

    same = merge_step(**_params(run_root, tmp_path, 1, release_root=str(tmp_path / "second"), reference_url=reference).flow_parameters())
    checks = _checks(same.releases[0].url)
    assert checks["reference_values"]["ok"] and checks["reference_logits"]["ok"]
    assert_release_of_step(same.releases[0].url, template_run, 1)

    other = merge_step(**_params(run_root, tmp_path, 2, release_root=str(tmp_path / "second"), reference_url=reference).flow_parameters(),
                       return_state=True)
    with pytest.raises(ValidationFailed):
        other.result()
    assert not storage.list_files(release_url(str(tmp_path / "second"), ROLE, 2))
    assert not storage.list_files(str(tmp_path / "staging"))


def test_weights_format_transformers_releases_the_stored_moe_names_and_validates(prefect, family_runs, tmp_path):
    run_root = str(tmp_path / "run")
    shutil.copytree(family_runs["mixtral_w2"].root, run_root)
    step = int(Path(family_runs["mixtral_w2"].latest.step_dir).name.rsplit("_", 1)[1])
    outcome = merge_step(**MergeStepParams(run_root=run_root, step=step, staging_root=str(tmp_path / "staging"),
                                           weights_format="transformers", release_adapter=False).flow_parameters())
    (release,) = outcome.releases
    assert outcome.status == "published" and release.validation_ok
    assert read_manifest(release.url).options["weights_format"] == "transformers"
    # from outside: the tensors as the run stored them, bit for bit (transformers v5's in-memory names)
    assert_release_weights_equal(release.url, load_file(family_runs["mixtral_w2"].latest.reference_state_dict))
    checks = _checks(release.url)
    assert "in-memory names" in checks["expected_keys"]["detail"] and checks["forward"]["ok"]
    with safe_open(str(Path(release.url) / "model.safetensors"), "pt") as weights:
        names = set(weights.keys())
    assert "model.layers.0.mlp.experts.gate_up_proj" in names
    assert not any("block_sparse_moe" in name for name in names)
