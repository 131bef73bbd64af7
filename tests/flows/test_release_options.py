"""A release asked with other options than the live one (issue 20, point 6), on a real checkpoint.

- a bf16 release of a step already released in its stored dtype is refused naming the differing
  option (``dtype: as stored there, bfloat16 asked``) and offering a second release root; the
  message never suggests ``overwrite`` (it would replace the live release for every reader);
- the root it offers works: the bf16 release is published there, the live release is untouched;
- a step rewritten since its release (another checkpoint) still offers ``overwrite``.
"""

from __future__ import annotations

import re

from flows.merge_step import merge_step
from merge_engine.release.state import differing_options
from merge_engine.release.manifest import read_manifest
from merge_engine.release.folders import release_url
from tests.fixtures_pipeline import ROLE, copy_steps


def _merge(run_root: str, tmp_path, **options):
    return merge_step(run_root=run_root, step=1, staging_root=str(tmp_path / "staging"), validate_forward=False,
                      return_state=True, **options)


def test_a_release_in_another_dtype_names_the_option_and_offers_a_second_root(prefect, template_run, tmp_path):
    run_root = str(tmp_path / "run")
    copy_steps(template_run, run_root, [1])
    first = _merge(run_root, tmp_path).result()
    assert first.status == "published"
    live = release_url(f"{run_root}/releases", ROLE, 1)
    # the summary names the release, not the staging folder the publish removed (issue 20)
    assert f"of `{live}`" in first.releases[0].validation_summary
    assert str(tmp_path / "staging") not in first.releases[0].validation_summary
    fingerprint = read_manifest(live).fingerprint

    refused = _merge(run_root, tmp_path, dtype="bf16")
    assert refused.is_failed()
    message = refused.message
    assert "TargetExists" in message and "same checkpoint with other options" in message
    assert "dtype: as stored there, bfloat16 asked" in message
    assert "overwrite would replace it" in message and "pass overwrite" not in message
    second_root = re.search(r"e\.g\. (\S+)\)", message).group(1)
    assert second_root == f"{run_root}/releases-bfloat16"

    published = _merge(run_root, tmp_path, dtype="bf16", release_root=second_root).result()
    assert published.status == "published"
    assert read_manifest(release_url(second_root, ROLE, 1)).provenance.settings["dtype"] == "bfloat16"
    assert read_manifest(live).fingerprint == fingerprint  # the live release is as it was


def test_differing_options_compares_sizes_in_bytes_and_skips_unrecorded_ones():
    released = {"dtype": None, "max_shard_size": "5GB", "validate_forward": True}
    asked = {"dtype": "bfloat16", "max_shard_size": 5_000_000_000, "lora_alpha": 8}
    assert differing_options(released, asked) == [("dtype", None, "bfloat16")]
