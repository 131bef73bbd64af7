"""The provenance record a release's manifest keeps: its round trip through a real publish (every backend of
``root_url``), what an older or odd manifest reads as, and whom an adapter must reproduce."""

from __future__ import annotations

import pytest

from merge_engine.release.folders import release_url
from merge_engine.release.manifest import read_manifest
from merge_engine.release.provenance import ReleaseProvenance
from tests.merge_engine.release.test_state import PROVENANCE, published


class TestProvenance:
    def test_round_trips_through_the_manifest(self, root_url):
        release = published(root_url, release_url(root_url, "actor", 1))
        options = read_manifest(release).options
        assert options == {"kind": "model", "source_listing": "listing-1", "checkpoint_fingerprint": "ckpt-1",
                           "checkpoint_lora": True, "dtype": "bfloat16", "lora_alpha": 16.0, "hf_model_path": None}
        provenance = read_manifest(release).provenance
        assert provenance == PROVENANCE and provenance.lora_alpha == 16.0 and provenance.hf_model_path is None

    def test_an_older_or_odd_manifest_reads_as_unknown(self):
        """Fields a manifest lacks, or holds with the wrong type, are None: never guessed."""
        assert ReleaseProvenance.from_manifest_options(None) == ReleaseProvenance()
        odd = ReleaseProvenance.from_manifest_options({"checkpoint_lora": "yes", "source_listing": 3, "dtype": None})
        assert (odd.checkpoint_lora, odd.source_listing, odd.settings) == (None, None, {"dtype": None})

    def test_is_trained_model_of(self):
        """An adapter's logits must reproduce a model release only of its own checkpoint, alpha and config."""
        assert PROVENANCE.is_trained_model_of("ckpt-1", 16.0)
        assert not PROVENANCE.is_trained_model_of("ckpt-2", 16.0)
        assert not PROVENANCE.is_trained_model_of("ckpt-1", None)
        replaced = ReleaseProvenance(checkpoint_fingerprint="ckpt-1", settings={"hf_model_path": "s3://b/cfg"})
        assert not replaced.is_trained_model_of("ckpt-1", None)

    def test_settings_cannot_shadow_provenance(self):
        with pytest.raises(ValueError, match="kind"):
            ReleaseProvenance(kind="model", settings={"kind": "adapter"}).to_manifest_options()
