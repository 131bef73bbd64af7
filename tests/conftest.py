"""Session-wide test setup: quiet Prefect, isolated caches, shared fixtures from plugin modules."""

import os

os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

pytest_plugins = ["tests.fixtures_storage", "tests.fixtures_checkpoints", "tests.fixtures_pipeline", "tests.fixtures_ray",
                  "tests.fixtures_merged", "tests.fixtures_readers"]
