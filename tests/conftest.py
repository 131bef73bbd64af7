"""Session-wide test setup: quiet Prefect, isolated caches, shared fixtures from plugin modules."""

import atexit
import gc
import os
import shutil
import tempfile

os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One OpenMP/MKL thread per process (read when torch is first imported, here and in every subprocess): the
# suite's tensors are tiny, and the session keeps servers, Ray nodes, Prefect workers and CLI runs busy beside
# the tests on a 2-core machine, where torch's spinning OpenMP threads cost 10-40x the CPU of one thread
# (tests/merge_engine/lora/test_lowrank.py: 40 CPU s with the default 2 threads, 2 CPU s with 1, at load)
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
# Prefect's temporary servers (flows run in subprocesses, the demo) wait 20 s by default: not enough on a loaded machine
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "300")
# the engine's own memo (merge_engine.plan.hub_config_memo): one per session, never the user's ~/.cache
if "STEPMERGE_CACHE_DIR" not in os.environ:
    os.environ["STEPMERGE_CACHE_DIR"] = tempfile.mkdtemp(prefix="stepmerge-test-cache-")
    atexit.register(shutil.rmtree, os.environ["STEPMERGE_CACHE_DIR"], True)

pytest_plugins = ["tests.fixtures_storage", "tests.fixtures_checkpoints", "tests.fixtures_pipeline", "tests.fixtures_ray",
                  "tests.fixtures_merged", "tests.fixtures_readers"]


def pytest_collection_finish(session) -> None:
    """Move what import and collection made (torch, transformers, Prefect, the test items: most of the objects the
    session will hold) out of the cyclic collector's sight: they live as long as the session, and each full
    collection walked them all, e.g. each `merge_engine.storage.clear_filesystems` (every fault-proxy teardown)."""
    gc.collect()  # what import and collection left as garbage goes now: a frozen object is never freed
    gc.freeze()
