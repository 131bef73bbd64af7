"""Where releases live: the names of a role's model and adapter releases under the release root."""

from __future__ import annotations

import pytest

from merge_engine.release.folders import default_release_root, release_folder_name, release_url


class TestLayout:
    def test_names(self):
        """Model and adapter releases of a role (or of an SFT run) sit side by side under the release root."""
        root = default_release_root("s3://b/run")
        assert root == "s3://b/run/releases"
        assert release_url(root, "actor", 7) == "s3://b/run/releases/actor/global_step_7"
        assert release_url(root, "critic", 7, "adapter") == "s3://b/run/releases/critic-adapter/global_step_7"
        assert release_url(root, "", 3) == "s3://b/run/releases/model/global_step_3"
        assert release_folder_name("", "adapter") == "model-adapter"
        with pytest.raises(ValueError):
            release_folder_name("actor", "tokenizer")
