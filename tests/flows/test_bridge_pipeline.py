"""Runs whose trainer wrote Hugging Face weights itself go through the same pipeline as the others, from S3.

- verl with mbridge (``global_step_N/actor/model/huggingface/`` holding the weights, ``ckpt_contents.json`` written
  last), written by real megatron-core on CPU (`synthetic_runs.megatron`, ``qwen2_tp2_pp2_bridge_v2``);
- Megatron-Bridge's ``iter_N/hf/`` beside its native ``torch_dist`` checkpoint, assembled here (no Megatron-Bridge runs
  on these machines): ``hf/`` is transformers' ``save_pretrained`` of a known model, beside it the native
  checkpoint's file names, its ``.metadata`` last.

Each is copied to a bucket of the session's SeaweedFS server; merge_new_steps discovers, checks, verifies and publishes
it to s3://, without a merge: the release is the trainer's weights bit for bit, judged from outside stepmerge
(`tests.release_checks`), and transformers gives the model's logits. A Megatron-Bridge step whose native checkpoint is
still being written is not ready, and nothing is published for it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from safetensors.torch import load_file

from flows.merge_new_steps import merge_new_steps
from flows.params import WatchParams
from merge_engine import storage
from merge_engine.commands.merge import read_provenance
from merge_engine.release.verify import verify_folder
from tests.fixtures_storage import upload_step
from tests.merge_engine.layouts.test_bridge_hf_folder import write_bridge_step
from tests.release_checks import assert_model_logits, assert_release_of_megatron_job, assert_release_weights_equal

VERL_BRIDGE = "qwen2_tp2_pp2_bridge_v2"


@pytest.fixture(scope="module")
def verl_bridge_job(tmp_path_factory):
    """The verl mbridge step of `synthetic_runs.megatron`'s matrix, written alone by megatron-core."""
    from synthetic_runs.megatron import write_fixture_matrix

    return write_fixture_matrix(tmp_path_factory.mktemp("verl_bridge"), names=[VERL_BRIDGE])[VERL_BRIDGE]


def _watch(bucket: str, run_root: str, tmp_path: Path, **given) -> WatchParams:
    return WatchParams(run_root=run_root, release_root=f"{bucket}/releases", staging_root=str(tmp_path / "staging"),
                       **given)


def test_a_verl_mbridge_run_on_s3_is_published_as_the_trainer_wrote_it(prefect, verl_bridge_job, s3_bucket_url,
                                                                        tmp_path):
    run_root = f"{s3_bucket_url}/verl_run"
    upload_step(verl_bridge_job.step_dir, run_root)
    watch = merge_new_steps(**_watch(s3_bucket_url, run_root, tmp_path).flow_parameters())
    (outcome,) = watch.outcomes
    (release,) = outcome.releases
    assert (outcome.step, outcome.role, outcome.status) == (1, "actor", "published") and release.validation_ok
    assert release.url.startswith("s3://") and verify_folder(release.url).ok
    assert read_provenance(release.url)["layout"] == "megatron_bridge"
    assert_release_of_megatron_job(release.url, verl_bridge_job)


def test_a_megatron_bridge_run_on_s3_is_published_once_its_native_checkpoint_is_whole(prefect, s3_bucket_url,
                                                                                       tmp_path):
    step = tmp_path / "local" / "iter_0000005"
    model = write_bridge_step(step)
    run_root = f"{s3_bucket_url}/bridge_run"
    upload_step(step, run_root)
    params = _watch(s3_bucket_url, run_root, tmp_path)
    waiting = merge_new_steps(**params.flow_parameters())  # the native checkpoint has no .metadata yet
    assert waiting.outcomes == [] and len(waiting.waiting) == 1 and waiting.waiting[0].startswith("5 ")
    assert not storage.list_files(params.release_root_url, recursive=True)

    storage.write_bytes(storage.join(run_root, step.name, "metadata.json"), b'{"sharded_backend": "torch_dist"}')
    storage.write_bytes(storage.join(run_root, step.name, ".metadata"), b"m")
    watch = merge_new_steps(**params.flow_parameters())
    (outcome,) = watch.outcomes
    (release,) = outcome.releases
    assert (outcome.step, outcome.status) == (5, "published") and release.validation_ok
    assert verify_folder(release.url).ok and read_provenance(release.url)["layout"] == "megatron_bridge"
    assert_release_weights_equal(release.url, load_file(str(step / "hf" / "model.safetensors")))
    assert_model_logits(release.url, model)
