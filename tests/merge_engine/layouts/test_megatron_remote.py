"""Megatron steps discovered and merged straight from object storage: SeaweedFS S3 and fake-GCS.

A verl legacy checkpoint (per-rank ``model.pt``, TP 2) and a verl 0.9 ``dist_ckpt`` (torch_dist, TP 2 x PP 2),
written by megatron-core (the session's ``megatron_runs``), are uploaded once per store to a bucket. Then, on
each store:
- discovery lists each run root's step as complete, with its layout, from the listing alone;
- ``merge --backend megatron`` from the bucket to the bucket gives the reference Hugging Face weights the
  checkpoint was written from, bit for bit, and transformers gives megatron-core's own logits: judged from
  outside stepmerge (`tests.release_checks`: the safetensors read from the bucket by its own client).
"""

from __future__ import annotations

import pytest

from merge_engine import storage
from merge_engine.commands.merge import merge_checkpoint
from merge_engine.output.jobs import OutputOptions
from merge_engine.layouts.discovery import discover_steps
from tests.fixtures_storage import apply_server_env, fresh_bucket_name
from tests.release_checks import assert_release_of_megatron_job

MEGATRON = {"qwen2_tp2_pp1_tied_legacy": "megatron_legacy", "mistral_tp2_pp2_tied_dist_v2": "megatron_dist"}


@pytest.fixture(scope="module", params=["s3", "gs"])
def bucket(request, megatron_runs) -> str:
    """A bucket on one store holding each checkpoint of `MEGATRON` as a run root ``<bucket>/<name>`` (uploaded
    once per store); the store's environment stays applied while this module's tests of that store run."""
    server = request.getfixturevalue("s3_server" if request.param == "s3" else "gcs_server")
    with pytest.MonkeyPatch.context() as patch:
        apply_server_env(patch, server)
        url = server.make_bucket(fresh_bucket_name())
        for name in MEGATRON:
            step_dir = megatron_runs[name].step_dir
            storage.copy_tree(str(step_dir), storage.join(url, name, step_dir.name))
        yield url
        storage.clear_filesystems()  # clients of this environment


@pytest.mark.parametrize("name", MEGATRON)
def test_a_megatron_step_is_discovered_complete_from_the_bucket(bucket, megatron_runs, name):
    (step,) = discover_steps(storage.join(bucket, name))
    assert (step.step, step.role, step.layout, step.complete) == (1, "actor", MEGATRON[name], True)
    assert step.url == storage.join(bucket, name, "global_step_1", "actor")


@pytest.mark.parametrize("name", MEGATRON)
def test_a_megatron_step_is_merged_from_the_bucket_bit_for_bit(bucket, megatron_runs, name):
    source = storage.join(bucket, name, "global_step_1", "actor")
    target = storage.join(bucket, f"merged-{name}")
    result = merge_checkpoint(source, target, OutputOptions(backend="megatron"))
    assert result.target_url == target
    assert_release_of_megatron_job(target, megatron_runs[name])  # the known weights, megatron-core's logits
