"""The outside checks (`tests.release_checks`) catch what stepmerge's own verdict cannot.

A release published by merge_step passes them; then ONE weight is changed by one, with the release's
``stepmerge.json``, manifest and marker made to agree (`flip_one_weight`): `stepmerge verify` (full
and quick) still calls it intact and readers still trust it, but the weights compared with the
reference, transformers' logits and PEFT's logits of the adapter all fail, naming the tensor.
"""

from __future__ import annotations

import pytest

from flows.merge_step import merge_step
from flows.params import MergeStepParams
from merge_engine.release.manifest import is_released
from merge_engine.release.verify import verify_folder
from tests.fixtures_pipeline import LORA_STEP, copy_steps
from tests.release_checks import (
    assert_adapter_logits,
    assert_model_logits,
    assert_release_weights_equal,
    flip_one_weight,
)


def _publish(run_root: str, step: int, tmp_path) -> dict:
    outcome = merge_step(**MergeStepParams(run_root=run_root, step=step,
                                           staging_root=str(tmp_path / "staging")).flow_parameters())
    assert outcome.status == "published"
    return {r.kind: r.url for r in outcome.releases}


@pytest.mark.parametrize("where", ["local", "s3"])
def test_one_flipped_weight_passes_verify_and_fails_the_outside_check(prefect, template_run, tmp_path, where, request):
    root = str(tmp_path / "run") if where == "local" else f"{request.getfixturevalue('s3_bucket_url')}/run"
    copy_steps(template_run, root, [1])
    release = _publish(root, 1, tmp_path)["model"]
    reference = template_run.reference_weights(1)
    assert_release_weights_equal(release, reference)
    assert_model_logits(release, template_run.trained_model(1))

    tensor = flip_one_weight(release)
    assert verify_folder(release).ok and verify_folder(release, mode="quick").ok and is_released(release)
    with pytest.raises(AssertionError, match=f"{tensor} differs from the reference"):
        assert_release_weights_equal(release, reference)
    with pytest.raises(AssertionError, match="logits differ"):
        assert_model_logits(release, template_run.trained_model(1))


def test_a_flipped_adapter_or_fused_weight_fails_the_outside_check(prefect, template_run, tmp_path):
    root = str(tmp_path / "run")
    copy_steps(template_run, root, [LORA_STEP])
    releases = _publish(root, LORA_STEP, tmp_path)
    trained = template_run.trained_model(LORA_STEP)
    assert_adapter_logits(releases["adapter"], trained)
    assert_model_logits(releases["model"], trained, rtol=1e-5)
    assert_release_weights_equal(releases["model"], template_run.reference_weights(LORA_STEP))

    for release in releases.values():
        flip_one_weight(release)
        assert verify_folder(release).ok
    with pytest.raises(AssertionError, match="logits differ"):
        assert_adapter_logits(releases["adapter"], trained)
    with pytest.raises(AssertionError, match="logits differ"):
        assert_model_logits(releases["model"], trained, rtol=1e-5)
