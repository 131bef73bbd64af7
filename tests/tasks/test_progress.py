"""The progress artifact moves while bytes are written: created at 0 %, updated as on_bytes reports,
100 % at the end; updates from another thread (where Prefect's settings are not visible) are only
counted; outside a run nothing is created."""

from __future__ import annotations

import threading
from types import SimpleNamespace

from prefect import flow
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterId

from tasks.progress import ProgressArtifact, artifact_key, release_artifact_key


def _value(artifact_id) -> float:
    """The artifact's current value, asked for by id (a listing is one page: the session's server holds many)."""
    with get_client(sync_client=True) as client:
        (artifact,) = client.read_artifacts(artifact_filter=ArtifactFilter(id=ArtifactFilterId(any_=[artifact_id])))
        return float(artifact.data)


def test_the_progress_artifact_moves_with_the_bytes_written(prefect):
    seen = []

    @flow
    def writing() -> None:
        progress = ProgressArtifact(artifact_key("progress", "test", "moves"), "writing", min_interval_s=0)
        progress.on_plan(SimpleNamespace(total_size=1000))
        seen.append(_value(progress.artifact_id))
        for _ in range(3):
            progress.on_bytes(250)
            seen.append(_value(progress.artifact_id))
        worker = threading.Thread(target=progress.on_bytes, args=(100,))
        worker.start()
        worker.join()
        seen.append(_value(progress.artifact_id))  # not updated from the other thread
        progress.finish()
        seen.append(_value(progress.artifact_id))
        seen.append(progress.updates)

    writing()
    assert seen == [0.0, 25.0, 50.0, 75.0, 75.0, 100.0, 4]


def test_outside_a_run_it_only_counts():
    progress = ProgressArtifact("progress-offline", "offline", min_interval_s=0)
    progress.on_plan(SimpleNamespace(total_size=10))
    progress.on_bytes(5)
    progress.finish()
    assert progress.artifact_id is None and progress.percent == 50.0 and progress.updates == 0


def test_artifact_keys_are_valid_prefect_keys():
    key = release_artifact_key("progress", "s3://Bucket_1/Run 7/releases/actor/global_step_12")
    assert key.startswith("progress-actor-global-step-12-") and set(key) <= set("abcdefghijklmnopqrstuvwxyz0123456789-")
    assert release_artifact_key("p", "s3://a/releases/actor/global_step_1") != release_artifact_key(
        "p", "s3://b/releases/actor/global_step_1")
