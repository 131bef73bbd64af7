"""The pipeline does not care which layout a step has: Megatron checkpoints go through the same tasks.

Real Megatron checkpoints written by megatron-core on CPU (the session's ``megatron_runs``, shared
with the engine's tests: verl's legacy per-rank files with TP 2, and verl 0.9's dist_ckpt with
TP 2 x PP 2) are discovered, checked, merged, validated and published by the same merge_new_steps
run as FSDP ones, and a re-run is all cache hits. Each release is judged from outside stepmerge
(`tests.release_checks`): its weights are the reference Hugging Face weights converted from the Megatron
state the checkpoint was written from, bit for bit, and transformers gives megatron-core's own logits
(within 1e-4, as tests/merge_engine/layouts/test_megatron_merge.py).
"""

from __future__ import annotations

import pytest

from flows.merge_new_steps import merge_new_steps
from flows.merge_step import merge_step
from flows.params import MergeStepParams, WatchParams
from merge_engine import storage
from merge_engine.commands.merge import read_provenance
from merge_engine.release.manifest import read_manifest
from merge_engine.release.verify import verify_folder
from tests.release_checks import assert_release_of_megatron_job

MEGATRON = {"qwen2_tp2_pp1_tied_legacy": "megatron_legacy", "mistral_tp2_pp2_tied_dist_v2": "megatron_dist"}


@pytest.mark.parametrize("name", MEGATRON)
def test_a_megatron_run_is_merged_and_published_like_any_other(prefect, megatron_runs, tmp_path, name):
    job = megatron_runs[name]  # the session's checkpoints (read only: releases and staging go elsewhere)
    run_root = str(job.step_dir.parent)
    staging = str(tmp_path / "staging")
    releases = str(tmp_path / "releases")
    watch = merge_new_steps(**WatchParams(run_root=run_root, release_root=releases, staging_root=staging).flow_parameters())
    (outcome,) = watch.outcomes
    (release,) = outcome.releases
    assert outcome.status == "published" and release.validation_ok
    assert verify_folder(release.url).ok
    assert_release_of_megatron_job(release.url, job)  # judged from outside: the known weights, megatron-core's logits
    assert read_provenance(release.url)["layout"] == MEGATRON[name]
    assert read_manifest(release.url).validation["ok"]
    assert storage.exists(storage.join(release.url, "config.json"))

    again = merge_step(**MergeStepParams(run_root=run_root, step=1, release_root=releases, staging_root=staging).flow_parameters())
    assert again.cached
