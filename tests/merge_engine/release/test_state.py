"""Releases: the four states a release URL can be in, what the pipeline's stages ask a state, and the
published listing.

Releases are made by the real `publish` (small files with known bytes) on every backend of the
``root_url`` fixture (`tests.fixtures_storage`: local disk, fsspec's in-process ``memory``, SeaweedFS S3,
fake-GCS), like tests/merge_engine/release/test_publish.py.
"""

from __future__ import annotations

import hashlib
import json
import uuid

import pytest

from merge_engine import storage
from merge_engine.errors import InvalidConfig, TargetExists
from merge_engine.release.built import BuiltOutput
from merge_engine.release.publish import publish
from merge_engine.release.state import (
    ABSENT,
    DAMAGED,
    IN_PROGRESS,
    PUBLISHED,
    published_releases,
    release_state,
    state_of,
    withdraw_damaged,
)
from merge_engine.release.folders import MARKER, default_release_root, release_url
from merge_engine.release.provenance import ReleaseProvenance
from merge_engine.release.manifest import read_manifest

FILES = {"config.json": b'{"architectures": ["Qwen2ForCausalLM"]}', "model.safetensors": bytes(range(256)) * 8}
PROVENANCE = ReleaseProvenance(kind="model", source_listing="listing-1", checkpoint_fingerprint="ckpt-1",
                               checkpoint_lora=True, settings={"dtype": "bfloat16", "lora_alpha": 16.0,
                                                               "hf_model_path": None})


def published(root: str, release: str, fingerprint: str = "fp-1",
              provenance: ReleaseProvenance = PROVENANCE) -> str:
    staging = storage.join(root, "staging", uuid.uuid4().hex[:8])
    for name, data in FILES.items():
        storage.write_bytes(storage.join(staging, name), data)
    publish(staging, release, source="s3://run/global_step_7/actor", fingerprint=fingerprint,
            options=provenance.to_manifest_options(), validation=None, engine_version="0.1.0")
    return release


class TestState:
    def test_absent_then_published(self, root_url):
        release = release_url(default_release_root(root_url), "actor", 1)
        state = release_state(release)
        assert (state.status, state.released, state.intact, state.manifest) == (ABSENT, False, False, None)

        published(root_url, release)
        state = release_state(release)
        assert state.status == PUBLISHED and state.intact and state.released
        assert state.holds("fp-1") and not state.holds("fp-2")
        assert state.provenance == PROVENANCE

    def test_files_without_a_valid_marker_are_in_progress(self, root_url):
        """A publisher at work (or a crashed one's debris): files, no marker; or a marker for another manifest."""
        release = release_url(root_url, "actor", 1)
        storage.write_bytes(storage.join(release, "model.safetensors"), b"partial")
        assert release_state(release).status == IN_PROGRESS

        published(root_url, release)
        storage.write_bytes(storage.join(release, MARKER), json.dumps({"manifest_sha256": "0" * 64}).encode())
        state = release_state(release)
        assert state.status == IN_PROGRESS and not state.released and not state.holds("fp-1")

    def test_a_missing_or_resized_file_is_damaged_and_withdrawn(self, root_url):
        release = published(root_url, release_url(root_url, "actor", 1))
        storage.write_bytes(storage.join(release, "model.safetensors"), b"short")
        state = release_state(release)
        assert state.status == DAMAGED and state.released and not state.intact and not state.holds("fp-1")
        assert "model.safetensors" in state.reason

        assert withdraw_damaged(state)
        assert release_state(release).status == IN_PROGRESS  # readers stop trusting it; publish rewrites it
        assert not withdraw_damaged(release_state(release))

        storage.remove(storage.join(release, "config.json"))
        published(root_url, release)
        assert release_state(release).status == PUBLISHED

    def test_a_damaged_state_read_before_another_run_republished_withdraws_nothing(self, root_url):
        """A flow reads the state when its chain begins and publishes minutes later: if another run has
        published the release again meanwhile, the stale DAMAGED state must not take the new marker away."""
        release = published(root_url, release_url(root_url, "actor", 1))
        storage.write_bytes(storage.join(release, "model.safetensors"), b"short")
        stale = release_state(release)
        assert stale.status == DAMAGED
        published(root_url, release)  # another run: a new attempt, whole again
        assert release_state(release).status == PUBLISHED
        assert not withdraw_damaged(stale)
        assert release_state(release).status == PUBLISHED

    @pytest.mark.parametrize("hostile", [b"[" * 100_000, b"[1, 2]", b"\xff\xfe"])
    def test_a_hostile_marker_or_manifest_is_not_trusted(self, root_url, hostile):
        """A marker nested past Python's parser, a list, or bytes that are not UTF-8: never a crash,
        never a published release; the manifest alone is refused with a named error."""
        release = published(root_url, release_url(root_url, "actor", 1))
        manifest = storage.read_bytes(storage.join(release, "manifest.json"))
        storage.write_bytes(storage.join(release, MARKER), hostile)
        assert release_state(release).status == IN_PROGRESS

        storage.write_bytes(storage.join(release, "manifest.json"), hostile)
        with pytest.raises(InvalidConfig) as caught:
            read_manifest(release)
        assert caught.value.path.endswith("manifest.json")
        storage.write_bytes(storage.join(release, "manifest.json"), manifest)

    def test_a_release_from_other_input_is_refused_unless_overwrite(self, root_url):
        state = release_state(published(root_url, release_url(root_url, "actor", 1)))
        with pytest.raises(TargetExists, match="pass overwrite") as caught:
            state.refuse_other("fp-2", overwrite=False, what="model")
        assert caught.value.path == state.url
        state.refuse_other("fp-2", overwrite=True)
        state.refuse_other("fp-1", overwrite=False)
        release_state(release_url(root_url, "actor", 2)).refuse_other("fp-2", overwrite=False)  # absent: fine


class TestWhatTheStagesAsk:
    """The questions the pipeline's build, validate and publish stages ask one `ReleaseState` (read once)."""

    @staticmethod
    def built(root: str, release: str, fingerprint: str = "fp-1", validated: bool = True) -> tuple[str, str]:
        """A release published from a staging folder holding a ``stepmerge.json`` (as a build writes one);
        returns (release, staging folder: removed by the publish)."""
        from merge_engine.validate import Check, ValidationReport

        staging = storage.join(root, "staging", uuid.uuid4().hex[:8])
        record = {"layout": "fsdp", "tensors": 3, "tensor_bytes": 2048,
                  "files": {name: len(data) for name, data in FILES.items()},
                  "sha256": {name: hashlib.sha256(data).hexdigest() for name, data in FILES.items()}}
        for name, data in {**FILES, "stepmerge.json": json.dumps(record).encode()}.items():
            storage.write_bytes(storage.join(staging, name), data)
        report = ValidationReport(staging, (Check("forward", True, "logits"),)) if validated else None
        publish(staging, release, source="s3://run/global_step_7/actor", fingerprint=fingerprint,
                options=PROVENANCE.to_manifest_options(), validation=report, engine_version="0.1.0")
        return release, staging

    def test_a_build_already_published_is_found_with_its_counts_and_another_one_is_refused(self, root_url):
        release = release_url(root_url, "actor", 1)
        assert release_state(release).released_output("model", "s3://run/a", "fp-1") is None  # absent: build it
        self.built(root_url, release)
        state = release_state(release)
        found = state.released_output("model", "s3://run/a", "fp-1")
        assert (found.url, found.release, found.released, found.fingerprint) == (release, release, True, "fp-1")
        assert (found.layout, found.tensors, found.tensor_bytes) == ("fsdp", 3, 2048)  # its stepmerge.json
        assert (found.files, found.total_bytes) == (len(state.manifest.files), state.manifest.total_bytes)
        assert found.attempt != state.released_output("model", "s3://run/a", "fp-1").attempt
        with pytest.raises(TargetExists, match="pass overwrite"):
            state.released_output("model", "s3://run/a", "fp-2")
        assert state.released_output("model", "s3://run/a", "fp-2", overwrite=True) is None

    def test_an_output_already_released_reports_the_validation_its_manifest_recorded(self, root_url):
        release = release_url(root_url, "actor", 1)
        staging = storage.join(root_url, "staging", "kept")
        storage.write_bytes(storage.join(staging, "model.safetensors"), b"staged")
        output = BuiltOutput("model", "s3://run/a", staging, "fp-1", release=release)
        self.built(root_url, release)
        state = release_state(release)
        assert not state.already_released(output) and state.recorded_validation(output) is None  # validate it
        storage.remove(staging, recursive=True)  # published by an earlier run
        report = state.recorded_validation(output)
        assert state.already_released(output) and report.ok
        assert [(c.name, c.ok, c.detail) for c in report.checks] == [("forward", True, "logits")]
        recorded = {k: v for k, v in state.manifest.validation.items() if k != "summary"}
        assert report.to_dict() == recorded and report.summary() == state.manifest.validation["summary"]
        found = state.released_output("model", "s3://run/a", "fp-1")
        assert state.recorded_validation(found).summary() == state.manifest.validation["summary"]

        unvalidated = release_url(root_url, "actor", 2)
        self.built(root_url, unvalidated, validated=False)
        bare = release_state(unvalidated)
        report = bare.recorded_validation(bare.released_output("model", "s3://run/a", "fp-1"))
        assert not report.ok and "no validation recorded" in report.summary()

    def test_a_cached_publication_is_current_until_the_release_is_published_again(self, root_url):
        release, _ = self.built(root_url, release_url(root_url, "actor", 1))
        state = release_state(release)
        attempt = state.manifest.attempt
        assert state.is_current("fp-1", attempt)
        assert not state.is_current("fp-1", "another-attempt") and not state.is_current("fp-2", attempt)
        storage.remove(storage.join(release, MARKER))
        assert not release_state(release).is_current("fp-1", attempt)

    def test_a_state_read_earlier_is_reused_for_its_own_url_only(self, root_url):
        release = release_url(root_url, "actor", 1)
        known = release_state(release)
        assert state_of(release, known) is known
        other = state_of(release_url(root_url, "actor", 2), known)
        assert other.url == release_url(root_url, "actor", 2) and other is not known
        assert state_of(release).url == release


def test_published_releases_lists_only_trusted_folders(root_url):
    root = default_release_root(root_url)
    published(root_url, release_url(root, "actor", 1))
    published(root_url, release_url(root, "actor", 2, "adapter"))
    storage.write_bytes(storage.join(release_url(root, "actor", 3), "model.safetensors"), b"no marker")
    stale = published(root_url, release_url(root, "critic", 4))
    storage.write_bytes(storage.join(stale, MARKER), b"{}")

    assert published_releases(root) == {("actor", 1): release_url(root, "actor", 1),
                                        ("actor-adapter", 2): release_url(root, "actor", 2, "adapter")}
