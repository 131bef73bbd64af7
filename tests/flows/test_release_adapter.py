"""release_adapter: a step's LoRA adapter extracted to PEFT, validated by loading it, published.

On a run root with only the LoRA step: the adapter release holds adapter_config.json (r and alpha
from the run), adapter_model.safetensors and the clean base under base/; PEFT loads it (real
`PeftModel.from_pretrained`). A later merge_step of the same step publishes the trained model and
finds the adapter already released. A step without LoRA is refused with a named error.

The adapter is compared with the step's released model only when that release was built from this
very checkpoint (and alpha): a model release of another checkpoint at that place is not a reference.
A rank file still being written makes the step "not ready", as for merge_step (the same rule: green
only when a watcher of the run root will come back for it, tests/flows/test_watchers.py).
"""

from __future__ import annotations

import hashlib
import shutil

import pytest

from flows.merge_step import merge_step
from flows.params import AdapterParams, MergeStepParams
from flows.release_adapter import release_adapter
from merge_engine.errors import AdapterError
from merge_engine.release.manifest import is_released, read_manifest
from merge_engine.release.folders import release_url
from merge_engine.release.verify import verify_folder
from tests.fixtures_pipeline import LORA_STEP, ROLE, copy_steps, deploy_watcher, rank_file
from tests.release_checks import assert_adapter_logits, assert_release_of_step


def test_the_adapter_of_a_lora_step_is_released_and_loads_with_peft(prefect, template_run, tmp_path, monkeypatch):
    """... and the checkpoint's deep check runs once: the extraction uses the check task's record."""
    import merge_engine.commands.extract
    import tasks.check

    checked = []
    for module in (tasks.check, merge_engine.commands.extract):
        real = module.check_checkpoint
        monkeypatch.setattr(module, "check_checkpoint",
                            lambda url, backend=None, files=None, _real=real:
                            checked.append(url) or _real(url, backend, files))
    run_root = str(tmp_path / "run")
    copy_steps(template_run, run_root, [LORA_STEP])
    staging = str(tmp_path / "staging")
    outcome = release_adapter(**AdapterParams(run_root=run_root, step=LORA_STEP, staging_root=staging).flow_parameters())
    (adapter,) = outcome.releases
    assert outcome.status == "published" and adapter.kind == "adapter"
    assert len(checked) == 1 and checked[0].endswith(f"global_step_{LORA_STEP}/{ROLE}")
    assert verify_folder(adapter.url).ok
    checks = {c["name"]: c["ok"] for c in read_manifest(adapter.url).validation["checks"]}
    assert checks["peft_load"] and checks["adapter_fits_base"] and checks["adapter_finite"]
    assert "peft_logits" not in checks  # no merged model released yet to compare with
    # from outside: PEFT loads the release onto its base/ and gives the logits of PEFT's own model of the run
    assert_adapter_logits(adapter.url, template_run.trained_model(LORA_STEP))

    assert checks["trained_model"] and checks["trained_vs_adapter"]  # PEFT's trained model of the checkpoint

    full = merge_step(**MergeStepParams(run_root=run_root, step=LORA_STEP, staging_root=staging).flow_parameters())
    kinds = {r.kind: r for r in full.releases}
    assert not kinds["model"].already_published and kinds["adapter"].already_published
    assert kinds["adapter"].url == adapter.url
    model_checks = {c["name"]: c for c in read_manifest(kinds["model"].url).validation["checks"]}
    assert model_checks["trained_vs_fused"]["ok"] and not model_checks["trained_vs_fused"].get("skipped")
    assert_release_of_step(kinds["model"].url, template_run, LORA_STEP)


def test_a_fused_model_that_is_not_the_trained_model_is_not_published(prefect, template_run, tmp_path, monkeypatch):
    """The merge's staging folder is altered after the merge (layer 0's q_proj, a LoRA module, 2 % off):
    structure, finite values and the forward pass all pass; only the trained model tells. The run fails
    naming trained_vs_fused, and neither the model nor its adapter is published."""
    import tasks.build
    from safetensors.torch import load_file, save_file

    from merge_engine.errors import ValidationFailed

    tampered = "model.layers.0.self_attn.q_proj.weight"

    def wrong_merge(job, _real=tasks.build.run_job, **kwargs):
        result = _real(job, **kwargs)
        if job.command != "merge":
            return result
        for path in sorted((tmp_path / "staging").rglob("*.safetensors")):
            tensors = load_file(str(path))
            if tampered in tensors:
                tensors[tampered] = tensors[tampered] * 0.98
                save_file(tensors, str(path), metadata={"format": "pt"})
                return result
        raise AssertionError(f"{tampered} not found in the staged merge")

    monkeypatch.setattr(tasks.build, "run_job", wrong_merge)
    run_root = str(tmp_path / "run")
    copy_steps(template_run, run_root, [LORA_STEP])
    state = merge_step(**MergeStepParams(run_root=run_root, step=LORA_STEP, staging_root=str(tmp_path / "staging"),
                                         ).flow_parameters(), return_state=True)
    assert state.is_failed()
    with pytest.raises(ValidationFailed, match="trained_vs_fused: largest logit difference"):
        state.result()
    releases = str(tmp_path / "run" / "releases")
    assert not is_released(release_url(releases, ROLE, LORA_STEP))
    assert not is_released(release_url(releases, ROLE, LORA_STEP, "adapter"))


def test_a_step_without_lora_is_refused(prefect, template_run, tmp_path):
    run_root = str(tmp_path / "run")
    copy_steps(template_run, run_root, [1])
    state = release_adapter(**AdapterParams(run_root=run_root, step=1).flow_parameters(), return_state=True)
    with pytest.raises(AdapterError):
        state.result()


def test_a_model_release_of_another_checkpoint_is_not_the_reference(prefect, template_run, tmp_path):
    """The place of step 4's model release holds a model built from step 1 (a full fine-tune of the
    same shapes): PEFT's logits cannot equal it, and they must not be compared with it."""
    run_root = str(tmp_path / "run")
    copy_steps(template_run, run_root, [1, LORA_STEP])
    releases = tmp_path / "run" / "releases"
    staging = str(tmp_path / "staging")
    step_1 = merge_step(**MergeStepParams(run_root=run_root, step=1, staging_root=staging).flow_parameters()).releases[0].url
    shutil.copytree(step_1, release_url(str(releases), ROLE, LORA_STEP))
    assert is_released(release_url(str(releases), ROLE, LORA_STEP))

    outcome = release_adapter(**AdapterParams(run_root=run_root, step=LORA_STEP, staging_root=staging).flow_parameters())
    (adapter,) = outcome.releases
    assert outcome.status == "published" and adapter.validation_ok
    assert "peft_logits" not in {c["name"] for c in read_manifest(adapter.url).validation["checks"]}
    assert_adapter_logits(adapter.url, template_run.trained_model(LORA_STEP))  # the trained model, not step 1's


def test_the_model_release_of_this_checkpoint_is_the_reference(prefect, template_run, tmp_path):
    run_root = str(tmp_path / "run")
    copy_steps(template_run, run_root, [LORA_STEP])
    staging = str(tmp_path / "staging")
    merge_step(**MergeStepParams(run_root=run_root, step=LORA_STEP, staging_root=staging, release_adapter=False).flow_parameters())
    outcome = release_adapter(**AdapterParams(run_root=run_root, step=LORA_STEP, staging_root=staging).flow_parameters())
    checks = {c["name"]: c["ok"] for c in read_manifest(outcome.releases[0].url).validation["checks"]}
    assert checks["peft_logits"]
    assert_adapter_logits(outcome.releases[0].url, template_run.trained_model(LORA_STEP))


def test_a_rank_file_still_being_written_is_not_ready(prefect, template_run, tmp_path, monkeypatch):
    import tasks.check

    run_root = str(tmp_path / "run")
    copy_steps(template_run, run_root, [LORA_STEP])
    shard = tmp_path / "run" / rank_file(LORA_STEP, 1)
    whole = shard.read_bytes()
    shard.write_bytes(whole[: len(whole) // 3])
    real_check = tasks.check.check_checkpoint

    def check_while_the_writer_finishes(url, backend=None, files=None):
        try:
            return real_check(url, backend, files)
        finally:
            shard.write_bytes(whole)

    monkeypatch.setattr(tasks.check, "check_checkpoint", check_while_the_writer_finishes)
    watcher = deploy_watcher(run_root, f"watch-{tmp_path.name}")
    outcome = release_adapter(**AdapterParams(run_root=run_root, step=LORA_STEP, staging_root=str(tmp_path / "s")).flow_parameters())
    assert outcome.status == "not_ready" and "still being written" in outcome.reason
    assert f"the watcher {watcher} (on its schedule)" in outcome.reason  # who comes back for it
    assert outcome.releases == []


def test_the_adapter_extraction_runs_its_shard_jobs_on_ray(prefect, template_run, ray_cluster, tmp_path):
    """``ray_address``: the adapter and its clean base are written by one ``write-shard`` task run per
    file on the Ray cluster, under a ``write-shards`` subflow of the extraction task; their weight files
    are byte for byte those one worker writes (`extract_lora` with threads, outside Prefect), and the
    release manifest's sha256 of each is the shard job's, equal to a fresh sha256 of the published file."""
    from merge_engine import storage
    from merge_engine.output.executors.local import LocalExecutor
    from merge_engine.commands.extract import extract_lora
    from tests.fixtures_pipeline import flow_run_id
    from tests.flows.test_merge_step_ray import _shard_runs

    run_root = str(tmp_path / "run")
    copy_steps(template_run, run_root, [LORA_STEP])
    params = AdapterParams(run_root=run_root, step=LORA_STEP, staging_root=str(tmp_path / "staging"),
                           validate_forward=False, ray_address=ray_cluster)
    state = release_adapter(**params.flow_parameters(), return_state=True)
    (adapter,) = state.result().releases
    assert verify_folder(adapter.url).ok
    assert_adapter_logits(adapter.url, template_run.trained_model(LORA_STEP))

    checkpoint = f"{run_root}/global_step_{LORA_STEP}/{ROLE}"
    one = extract_lora(checkpoint, str(tmp_path / "one"), params.settings()["adapter"].to_options(),
                       executor=LocalExecutor(1))
    weights = sorted(f for f, _ in one.files if f.endswith((".safetensors", ".index.json")))
    assert "adapter_model.safetensors" in weights and any(f.startswith("base/") for f in weights)
    manifest = {f.path: f.sha256 for f in read_manifest(adapter.url).files}
    for file in weights:
        data = storage.read_bytes(storage.join(adapter.url, file))
        assert data == storage.read_bytes(str(tmp_path / "one" / file)), file
        # the manifest holds the shard jobs' checksums (publish checked the copies against them): fresh sha256
        assert manifest[file] == dict(one.checksums)[file] == hashlib.sha256(data).hexdigest(), file

    subflows, shard_tasks = _shard_runs(flow_run_id(state))
    assert [run.name for run in subflows] == [f"write-shards global_step_{LORA_STEP}/{ROLE}"]
    expected = sorted(f"global_step_{LORA_STEP}/{ROLE}: {f.rsplit('/', 1)[-1]}" for f in weights
                      if f.endswith(".safetensors"))
    assert sorted(run.name for run in shard_tasks) == expected
    assert all(run.state.name == "Completed" for run in shard_tasks)
