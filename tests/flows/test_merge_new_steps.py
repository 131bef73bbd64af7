"""merge_new_steps (the watcher): complete steps minus published steps, every run, one merge per step.

- a step still being written (a rank file missing) is skipped as "not ready", then merged once it
  is complete — on a gs:// run root (fake-gcs-server);
- no high-water mark: a lower step that appears after a higher one was released is merged;
- a published step is not merged again (no merge_step run for it);
- a LoRA step gives the trained model and a PEFT adapter whose logits equal it (judged from outside:
  `PeftModel.from_pretrained` of the released adapter gives the logits of PEFT's own model of the run, and
  the released model holds PEFT's ``merge_and_unload`` of it);
- every release holds the weights its step was written from (`tests.release_checks`);
- whether a step has an adapter is decided once, from its tensors (by merge_step, recorded in the
  model release's manifest), not guessed again from file names: a step with verl's LoRA metadata
  but no LoRA weights is not merged again on every tick;
- a rank file still being written (present, truncated, growing) is "not ready", not a failure: the
  tick succeeds, and the next one merges the step.
"""

from __future__ import annotations

import json

from flows.merge_new_steps import merge_new_steps
from flows.params import WatchParams
from merge_engine import storage
from merge_engine.release.manifest import is_released, read_manifest
from merge_engine.release.folders import release_url
from merge_engine.release.verify import verify_folder
from tests.fixtures_pipeline import LORA_STEP, copy_steps, rank_file
from tests.release_checks import assert_adapter_logits, assert_release_of_step


def _watch(run_root: str, tmp_path) -> WatchParams:
    return WatchParams(run_root=run_root, staging_root=str(tmp_path / "staging"))


def test_an_incomplete_step_is_skipped_then_merged_once_complete(prefect, template_run, gcs_bucket_url, tmp_path):
    run_root = f"{gcs_bucket_url}/run"
    missing = rank_file(2, 1)
    copy_steps(template_run, run_root, [1, 2], omit=[missing])

    first = merge_new_steps(**_watch(run_root, tmp_path).flow_parameters())
    assert first.steps_with("merged") == [1]
    assert len(first.waiting) == 1 and first.waiting[0].startswith("2 ")
    releases = f"{run_root}/releases"
    assert is_released(release_url(releases, "actor", 1)) and not is_released(release_url(releases, "actor", 2))
    assert_release_of_step(release_url(releases, "actor", 1), template_run, 1)

    storage.copy_file(str(template_run.root / missing), storage.join(run_root, missing))  # the last rank lands
    second = merge_new_steps(**_watch(run_root, tmp_path).flow_parameters())
    assert [(a.step, a.action) for a in second.actions] == [(2, "merged")]  # step 1: no merge_step run at all
    assert second.waiting == [] and second.published_before == 1
    assert verify_folder(release_url(releases, "actor", 2)).ok
    assert_release_of_step(release_url(releases, "actor", 2), template_run, 2)

    third = merge_new_steps(**_watch(run_root, tmp_path).flow_parameters())
    assert third.actions == [] and third.published_before == 2


def test_a_late_lower_step_is_merged(prefect, template_run, tmp_path):
    run_root = str(tmp_path / "run")
    copy_steps(template_run, run_root, [3])
    assert merge_new_steps(**_watch(run_root, tmp_path).flow_parameters()).steps_with("merged") == [3]
    copy_steps(template_run, run_root, [1])  # written after step 3 was released (e.g. an async save)
    late = merge_new_steps(**_watch(run_root, tmp_path).flow_parameters())
    assert late.steps_with("merged") == [1]
    assert is_released(release_url(str(tmp_path / "run" / "releases"), "actor", 1))
    for step in (3, 1):
        assert_release_of_step(release_url(str(tmp_path / "run" / "releases"), "actor", step), template_run, step)


def test_a_lora_step_releases_the_trained_model_and_its_adapter(prefect, template_run, tmp_path):
    run_root = str(tmp_path / "run")
    copy_steps(template_run, run_root, [4])
    watch = merge_new_steps(**_watch(run_root, tmp_path).flow_parameters())
    (outcome,) = watch.outcomes
    kinds = {r.kind: r for r in outcome.releases}
    assert set(kinds) == {"model", "adapter"}
    adapter_release = kinds["adapter"].url
    assert adapter_release.endswith("actor-adapter/global_step_4") and verify_folder(adapter_release).ok
    checks = {c["name"]: c for c in read_manifest(adapter_release).validation["checks"]}
    assert checks["peft_load"]["ok"] and checks["peft_logits"]["ok"]  # the product's verdict: PEFT(base + adapter) == fused
    # from outside: PEFT loads the released adapter onto its base/ and gives the logits of PEFT's own model of
    # the run; the released model is PEFT's merge_and_unload of it, bit for bit
    assert_adapter_logits(adapter_release, template_run.trained_model(LORA_STEP))
    assert_release_of_step(kinds["model"].url, template_run, LORA_STEP)
    config = json.loads(storage.read_text(storage.join(adapter_release, "adapter_config.json")))
    assert config["lora_alpha"] == 8 and config["r"] == 4
    assert config["base_model_name_or_path"] == "base"  # beside it, wherever the release is copied
    assert storage.exists(storage.join(adapter_release, "base", "model.safetensors"))

    from flows.merge_step import merge_step

    again = merge_step(**watch_step_params(run_root, tmp_path).flow_parameters())
    assert again.cached  # the adapter's expected fingerprint is the one extract_lora wrote


def watch_step_params(run_root, tmp_path):
    from flows.params import MergeStepParams

    return MergeStepParams(run_root=run_root, step=4, staging_root=str(tmp_path / "staging"))


def test_a_step_with_lora_metadata_but_no_lora_weights_is_merged_once(prefect, template_run, tmp_path):
    run_root = str(tmp_path / "run")
    copy_steps(template_run, run_root, [1])
    (tmp_path / "run" / "global_step_1" / "actor" / "lora_train_meta.json").write_text(
        json.dumps({"r": 4, "lora_alpha": 8, "task_type": "CAUSAL_LM"}))  # the run said LoRA; the weights say no
    first = merge_new_steps(**_watch(run_root, tmp_path).flow_parameters())
    assert first.steps_with("merged") == [1]
    (outcome,) = first.outcomes
    assert [r.kind for r in outcome.releases] == ["model"]
    assert read_manifest(outcome.releases[0].url).options["checkpoint_lora"] is False
    assert_release_of_step(outcome.releases[0].url, template_run, 1)
    second = merge_new_steps(**_watch(run_root, tmp_path).flow_parameters())
    assert second.actions == []  # nothing expected that merge_step would not make


def test_a_rank_file_still_being_written_is_not_ready_then_merged(prefect, template_run, tmp_path, monkeypatch):
    """The last rank file is there but short (its writer is still going): the listing calls the step
    complete, the deep check finds it truncated; by the time the step is listed again the file has
    grown. The tick reports the step as not ready and succeeds; the next tick merges it."""
    import tasks.check

    run_root = str(tmp_path / "run")
    copy_steps(template_run, run_root, [1])
    shard = tmp_path / "run" / rank_file(1, 1)
    whole = shard.read_bytes()
    shard.write_bytes(whole[: len(whole) // 2])
    real_check = tasks.check.check_checkpoint
    writing = [True]

    def check_while_the_writer_finishes(url, backend=None, files=None):
        try:
            return real_check(url, backend, files)
        finally:
            if writing:  # the writer finishes once, during the first check (a rewrite later is a change too)
                shard.write_bytes(whole)
                writing.clear()

    monkeypatch.setattr(tasks.check, "check_checkpoint", check_while_the_writer_finishes)
    state = merge_new_steps(**_watch(run_root, tmp_path).flow_parameters(), return_state=True)
    assert state.is_completed()
    first = state.result()
    assert [(a.step, a.action) for a in first.actions] == [(1, "not ready")]
    assert "still being written" in first.actions[0].detail
    assert not is_released(release_url(str(tmp_path / "run" / "releases"), "actor", 1))
    second = merge_new_steps(**_watch(run_root, tmp_path).flow_parameters())
    assert second.steps_with("merged") == [1]
    assert verify_folder(release_url(str(tmp_path / "run" / "releases"), "actor", 1)).ok
    assert_release_of_step(release_url(str(tmp_path / "run" / "releases"), "actor", 1), template_run, 1)
