"""DeepSpeed ZeRO runs go through the same pipeline as verl's.

The session's ``zero_runs`` (saved by DeepSpeed 0.19.8 itself over 2 gloo ranks: ZeRO-1 and ZeRO-2 in bf16 inside
HF Trainer's ``checkpoint-1/``, its config beside the tag folder; ZeRO-3 in fp32 as a bare engine's ``global_step1/``,
merged with the model's ``hf_model_path``) are copied to a bucket of the session's SeaweedFS server; merge_new_steps
discovers, checks, merges, validates and publishes each to s3://. Each release is judged from outside stepmerge
(`tests.release_checks`): the fp32 weights the run was built from, bit for bit, and transformers' logits of that
model, exactly. Every ranged GET is counted: HF Trainer's bf16 ``model.safetensors`` beside the tag folder is never
read, and a re-run is a cache hit that reads no byte of the step's files.
"""

from __future__ import annotations

import pytest

from flows.merge_new_steps import merge_new_steps
from flows.merge_step import merge_step
from flows.params import MergeStepParams, WatchParams
from merge_engine.commands.merge import read_provenance
from merge_engine.release.verify import verify_folder
from tests.fixtures_storage import upload_step
from tests.release_checks import assert_release_of_step




@pytest.mark.parametrize("name", ["zero1_bf16", "zero2_bf16", "zero3_fp32"])
def test_a_zero_run_on_s3_is_discovered_merged_validated_and_published(prefect, zero_runs, s3_bucket_url, tmp_path,
                                                                       s3_gets, name):
    run = zero_runs[name]
    run_root = f"{s3_bucket_url}/run"
    copied = upload_step(run.step_dir(1), run_root)
    params = WatchParams(run_root=run_root, release_root=f"{s3_bucket_url}/releases",
                         staging_root=str(tmp_path / "staging"),
                         hf_model_path=run.hf_config_dir if run.spec.trainer == "deepspeed" else None)
    watch = merge_new_steps(**params.flow_parameters())
    (outcome,) = watch.outcomes
    (release,) = outcome.releases
    assert outcome.status == "published" and release.validation_ok and release.url.startswith("s3://")
    assert verify_folder(release.url).ok
    assert read_provenance(release.url)["layout"] == "deepspeed_zero"
    assert_release_of_step(release.url, run, 1)  # judged from outside: the fp32 weights and the model's logits

    assert not [u for u, _, _ in s3_gets if u in copied and u.endswith("model.safetensors")]  # HF Trainer's bf16 copy

    s3_gets.clear()
    again = merge_step(**MergeStepParams(run_root=run_root, step=1, role="", release_root=params.release_root,
                                         staging_root=params.staging_root,
                                         hf_model_path=params.hf_model_path).flow_parameters())
    assert again.cached and [r.url for r in again.releases] == [release.url]
    assert not [u for u, _, _ in s3_gets if u in copied]  # a re-run reads no byte of the step's files
