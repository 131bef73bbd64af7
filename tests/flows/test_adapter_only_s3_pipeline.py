"""Adapter-only LoRA steps on S3 go through the pipeline fused into the base model the run is given.

- verl's ``save_lora_only`` step: ``global_step_N/actor/`` rank files holding only the LoRA keys (the session's
  ``template_run`` LoRA step, FSDP2 over 2 ranks, r=4, alpha=8 in ``lora_train_meta.json``, every other key dropped
  from each rank file as that save drops them), through the watcher (merge_new_steps);
- HF Trainer's DCP ``adapter_only`` save through Accelerate (the session's ``dcp_lora_runs["adapter"]``:
  ``checkpoint-1/pytorch_model_fsdp_0/`` holding PEFT's adapter state dict only; no config, no alpha saved),
  through merge_step with ``lora_alpha``.

Each step is copied to a bucket of the session's SeaweedFS server and its base model (transformers'
``save_pretrained`` of the model the run trained from) beside it. With ``base_model`` (an s3:// URL) the flow
merges, validates and publishes to s3:// the fused model and the adapter. Judged from outside stepmerge
(`tests.release_checks`): the model release holds PEFT's own ``merge_and_unload`` of the trained model in fp32, bit
for bit, transformers loads it strictly with the trained model's logits; the adapter release holds PEFT's own adapter
state bit for bit and, under ``base/``, the base it was given bit for bit (named ``base`` in its config); PEFT loads
the release alone (``release/base``, then ``release``) with the same logits. Without ``base_model`` the step's merge fails with the named error that
says to pass it (`AdapterError`), and nothing is published.
"""

from __future__ import annotations

import copy
import json
import tempfile
from pathlib import Path

import pytest
import torch

from flows.merge_new_steps import merge_new_steps
from flows.merge_step import merge_step
from flows.params import MergeStepParams, WatchParams
from merge_engine import storage
from merge_engine.commands.merge import read_provenance
from merge_engine.errors import AdapterError
from merge_engine.release.verify import verify_folder
from tests.fixtures_pipeline import LORA_STEP, TemplateRun
from tests.fixtures_storage import upload_step
from tests.release_checks import (
    TOKENS, assert_model_logits, assert_no_machine_paths, assert_release_weights_equal, download, load_model, read_file,
    release_tensors,
)

FUSED_RTOL = 1e-5  # PEFT's unfused forward adds B @ A x in another order than the fused weight's matmul


def _lora_only(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: tensor for name, tensor in state.items() if ".lora_" in name}


@pytest.fixture(scope="session")
def verl_lora_only_step(tmp_path_factory, template_run: TemplateRun) -> Path:
    """The template run's LoRA step as verl's ``save_lora_only`` writes it: the same folder, each model rank file
    holding only its LoRA keys."""
    import shutil

    import torch.distributed.tensor  # noqa: F401 - the rank files hold DTensors

    step = tmp_path_factory.mktemp("verl_lora_only") / f"global_step_{LORA_STEP}"
    shutil.copytree(template_run.step_dir(LORA_STEP), step)
    rank_files = sorted((step / "actor").glob("model_world_size_*_rank_*.pt"))
    assert rank_files
    for path in rank_files:
        torch.save(_lora_only(torch.load(path, weights_only=True)), path)
    return step


@pytest.fixture(scope="session")
def template_base(tmp_path_factory, template_run: TemplateRun) -> Path:
    """The base model the template run's LoRA step trained from, as transformers saves it."""
    folder = tmp_path_factory.mktemp("template_base")
    copy.deepcopy(template_run.trained_model(LORA_STEP)).unload().save_pretrained(str(folder))
    return folder


@pytest.fixture(scope="session")
def dcp_adapter_base(tmp_path_factory, dcp_lora_runs) -> Path:
    """The base model of HF Trainer's adapter-only DCP step, as transformers saves it."""
    from synthetic_runs.models import build_model

    step = dcp_lora_runs["adapter"]
    folder = tmp_path_factory.mktemp("dcp_adapter_base")
    build_model(step.spec.model, step.seed, torch.float32).eval().save_pretrained(str(folder))
    return folder


def _upload_folder(folder: Path, url: str) -> str:
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        storage.copy_file(str(path), storage.join(url, path.relative_to(folder).as_posix()))
    return url


def _watch(bucket: str, run_root: str, tmp_path: Path, **given) -> WatchParams:
    return WatchParams(run_root=run_root, release_root=f"{bucket}/releases", staging_root=str(tmp_path / "staging"),
                       **given)


def _fused(trained: torch.nn.Module) -> dict[str, torch.Tensor]:
    """PEFT's own merge of ``trained`` in fp32 (the tied head is the embedding: not stored twice)."""
    fused = copy.deepcopy(trained).float().merge_and_unload()
    state = {name: tensor.detach().clone().contiguous() for name, tensor in fused.state_dict().items()}
    if fused.config.tie_word_embeddings:
        del state["lm_head.weight"]
    return state


def _assert_fused_release(outcome, trained: torch.nn.Module, base: Path, base_url: str) -> str:
    """The step's model release is PEFT's merge of ``trained`` bit for bit and transformers loads it strictly with
    ``trained``'s logits; its adapter release holds PEFT's own adapter state of ``trained`` bit for bit and, under
    ``base/``, the base it was given (``base``, a local copy of ``base_url``) bit for bit; its config names that base
    ``base``, and PEFT loading the release alone (``release/base``, then ``release``) gives the same logits. Returns
    the model release's URL."""
    import peft

    releases = {release.kind: release for release in outcome.releases}
    assert outcome.status == "published" and set(releases) == {"model", "adapter"}
    for release in releases.values():
        assert release.validation_ok and release.url.startswith("s3://") and verify_folder(release.url).ok
        assert_no_machine_paths(release.url)
    model, adapter = releases["model"].url, releases["adapter"].url
    fused, clean = _fused(trained), load_model(str(base)).state_dict()
    assert [name for name, tensor in fused.items() if not torch.equal(tensor, clean[name])]  # the LoRA is not a no-op
    assert_release_weights_equal(model, fused)
    assert_model_logits(model, trained, rtol=FUSED_RTOL)

    assert_release_weights_equal(adapter, peft.get_peft_model_state_dict(trained))
    assert_release_weights_equal(f"{adapter}/base", release_tensors(str(base)))  # the base given, bit for bit
    assert json.loads(read_file(adapter, "adapter_config.json"))["base_model_name_or_path"] == "base"
    with tempfile.TemporaryDirectory(prefix="outside-adapter-") as local:
        release = download(adapter, local)
        loaded = peft.PeftModel.from_pretrained(load_model(f"{release}/base"), release)  # the release alone
        _assert_close_logits(adapter, loaded, trained)
    return model


def _assert_close_logits(url: str, got: torch.nn.Module, expected: torch.nn.Module) -> None:
    """``got``'s logits on `TOKENS` are ``expected``'s within `FUSED_RTOL` of their scale."""
    with torch.no_grad():
        have, want = (m.eval()(input_ids=TOKENS).logits for m in (got, expected))
    diff, scale = (have - want).abs().max().item(), want.abs().max().item()
    assert diff <= FUSED_RTOL * scale, f"{url}: logits differ by {diff:g} (scale {scale:g})"


def test_a_verl_lora_only_step_on_s3_is_released_fused_into_the_base(prefect, template_run, verl_lora_only_step,
                                                                     template_base, s3_bucket_url, tmp_path):
    run_root = f"{s3_bucket_url}/verl_run"
    upload_step(verl_lora_only_step, run_root)
    base_url = _upload_folder(template_base, f"{s3_bucket_url}/base")
    bare = _watch(s3_bucket_url, run_root, tmp_path)
    with pytest.raises(RuntimeError, match=f"{LORA_STEP} \\(AdapterError: .*no base model: pass --base-model"):
        merge_new_steps(**bare.flow_parameters())
    assert not storage.list_files(bare.release_root_url, recursive=True)

    watch = merge_new_steps(**_watch(s3_bucket_url, run_root, tmp_path, base_model=base_url).flow_parameters())
    (outcome,) = watch.outcomes
    assert (outcome.step, outcome.role) == (LORA_STEP, "actor")
    url = _assert_fused_release(outcome, template_run.trained_model(LORA_STEP), template_base, base_url)
    recorded = read_provenance(url)
    assert recorded["base_model"] == base_url and recorded["lora"]["lora_alpha"] == 8


def test_hf_trainers_dcp_adapter_only_step_on_s3_is_released_fused_into_the_base(prefect, dcp_lora_runs,
                                                                                  dcp_adapter_base, s3_bucket_url,
                                                                                  tmp_path):
    from synthetic_runs.fsdp import build_reference_model

    step = dcp_lora_runs["adapter"]
    run_root = f"{s3_bucket_url}/trainer_run"
    upload_step(step.step_dir, run_root)
    base_url = _upload_folder(dcp_adapter_base, f"{s3_bucket_url}/base")
    release_root = f"{s3_bucket_url}/releases"
    given = dict(run_root=run_root, step=1, role="", release_root=release_root, staging_root=str(tmp_path / "staging"),
                 lora_alpha=8)
    with pytest.raises(AdapterError, match="no base model: pass --base-model"):  # its config given: the base is missing
        merge_step(**MergeStepParams(**given, hf_model_path=str(dcp_adapter_base)).flow_parameters())
    assert not storage.list_files(release_root, recursive=True)

    outcome = merge_step(**MergeStepParams(**given, base_model=base_url).flow_parameters())
    assert outcome.step == 1
    url = _assert_fused_release(outcome, build_reference_model(step.spec, step.seed), dcp_adapter_base, base_url)
    recorded = read_provenance(url)
    assert recorded["base_model"] == base_url and recorded["lora"]["lora_alpha"] == 8
    assert recorded["layout"] == "torch_dcp"


def test_the_watcher_given_base_model_releases_hf_trainers_dcp_adapter_only_step(prefect, dcp_lora_runs,
                                                                                   dcp_adapter_base, s3_bucket_url,
                                                                                   tmp_path):
    """merge_new_steps with ``base_model`` (and ``lora_alpha``) on HF Trainer's adapter-only DCP step saved without a
    config: the merge takes the base's config, as ``merge --base-model`` and merge_step do, so the step is merged and
    released, not refused as needing ``hf_model_path``."""
    from synthetic_runs.fsdp import build_reference_model

    step = dcp_lora_runs["adapter"]
    run_root = f"{s3_bucket_url}/trainer_run"
    upload_step(step.step_dir, run_root)
    base_url = _upload_folder(dcp_adapter_base, f"{s3_bucket_url}/base")
    watch = merge_new_steps(**_watch(s3_bucket_url, run_root, tmp_path, lora_alpha=8,
                                     base_model=base_url).flow_parameters())
    (outcome,) = watch.outcomes
    assert outcome.step == 1
    _assert_fused_release(outcome, build_reference_model(step.spec, step.seed), dcp_adapter_base, base_url)
