"""merge_step from an s3:// run root to s3:// releases, on a real SeaweedFS server and a real Prefect API.

- end to end: a 2-rank FSDP step in a bucket becomes a release in the bucket holding the weights the
  step was written from, bit for bit, that transformers loads with the model's own logits (judged from
  outside stepmerge, `tests.release_checks`); every file matches its manifest's sha256, with the
  validation report, a markdown artifact and a progress artifact that reached 100 %;
- a re-run is a cache hit: the check and the output's chain are Cached, no stage in it runs, and no byte
  of the checkpoint or the release is read (every ranged read is counted; the only reads are small metadata files);
- deleting the release makes the next run rebuild it (the same weights again, judged from outside).
"""

from __future__ import annotations

import json


from flows.merge_step import merge_step, summary_key
from flows.params import MergeStepParams
from merge_engine import storage
from merge_engine.release.folders import MARKER, release_url
from merge_engine.release.manifest import is_released, read_manifest
from merge_engine.release.verify import verify_folder
from tests.fixtures_pipeline import copy_steps, flow_run_id, latest_artifacts, task_runs
from tests.release_checks import assert_release_of_step

CHAIN_TASKS = ("merge-model", "validate-model", "publish-release")  # nested in the output's task, model-release
STAGE_TASKS = ("check-checkpoint", "model-release", *CHAIN_TASKS)


def _params(bucket: str, tmp_path, step: int = 1) -> MergeStepParams:
    return MergeStepParams(run_root=f"{bucket}/run", step=step, staging_root=str(tmp_path / "staging"))


def _small_reads(monkeypatch) -> list[str]:
    """URLs read whole with storage.read_bytes (markers, manifests, configs: never weights)."""
    urls: list[str] = []
    original = storage.read_bytes

    def read_bytes(url: str) -> bytes:
        urls.append(url)
        return original(url)

    monkeypatch.setattr(storage, "read_bytes", read_bytes)
    return urls


def test_an_s3_step_is_merged_validated_and_published_to_s3(prefect, template_run, s3_bucket_url, tmp_path):
    copy_steps(template_run, f"{s3_bucket_url}/run", [1])
    state = merge_step(**_params(s3_bucket_url, tmp_path).flow_parameters(), return_state=True)
    outcome = state.result()

    release = release_url(f"{s3_bucket_url}/run/releases", "actor", 1)
    assert outcome.status == "published" and [r.url for r in outcome.releases] == [release]
    assert release.startswith("s3://")
    assert_release_of_step(release, template_run, 1)  # the step's own weights and logits, judged from outside
    assert verify_folder(release).ok  # every file re-hashed against the manifest
    manifest = read_manifest(release)
    assert manifest.source == f"{s3_bucket_url}/run/global_step_1/actor"
    assert manifest.validation["ok"] and "forward" in {c["name"] for c in manifest.validation["checks"]}
    assert manifest.options["source_listing"] and manifest.options["kind"] == "model"
    names = {e.path for e in storage.list_files(release)}
    assert {"config.json", "model.safetensors", "manifest.json", MARKER, "tokenizer.json"} <= names
    assert [s.name for s in outcome.stages] == ["discover", "check", "model-release", "merge", "validate", "publish"]

    runs = task_runs(flow_run_id(state), STAGE_TASKS)
    assert all(runs[name][0].state.name == "Completed" for name in STAGE_TASKS)
    (markdown,) = latest_artifacts(summary_key(_params(s3_bucket_url, tmp_path)))
    assert release in markdown.data and "Validation PASSED" in markdown.data and "| merge |" in markdown.data
    progress = [a for a in latest_artifacts(key_like="progress-actor-global-step-1")
                if a.type == "progress" and a.key and a.key.startswith("progress-actor-global-step-1")]
    assert progress and float(progress[0].data) == 100.0


def test_a_rerun_is_a_cache_hit_that_reads_no_weight_byte(prefect, template_run, s3_bucket_url, tmp_path,
                                                          weight_reads, monkeypatch):
    copy_steps(template_run, f"{s3_bucket_url}/run", [2])
    first = merge_step(**_params(s3_bucket_url, tmp_path, 2).flow_parameters())
    weight_reads.reads.clear()
    small = _small_reads(monkeypatch)

    state = merge_step(**_params(s3_bucket_url, tmp_path, 2).flow_parameters(), return_state=True)
    outcome = state.result()
    assert outcome.cached and outcome.status == "already_published"
    assert outcome.releases[0].url == first.releases[0].url
    assert [(s.name, s.state) for s in outcome.stages] == [("discover", "Completed"), ("check", "Cached"),
                                                           ("model-release", "Cached")]  # no stage nested in it ran
    cached = ("check-checkpoint", "model-release")
    runs = task_runs(flow_run_id(state), cached)  # waits for the recorded states (events, after the call)
    assert {name: runs[name][0].state.name for name in cached} == dict.fromkeys(cached, "Cached")
    assert not set(CHAIN_TASKS) & set(runs)
    assert weight_reads.reads == []  # not one ranged read: no checkpoint or model byte
    metadata = (MARKER, "manifest.json", "latest_checkpointed_iteration.txt")
    assert small and all(url.rsplit("/", 1)[-1] in metadata for url in small)


def test_deleting_the_release_makes_the_next_run_rebuild_it(prefect, template_run, s3_bucket_url, tmp_path):
    copy_steps(template_run, f"{s3_bucket_url}/run", [3])
    first = merge_step(**_params(s3_bucket_url, tmp_path, 3).flow_parameters())
    release = first.releases[0].url
    attempt = read_manifest(release).attempt
    storage.remove(release, recursive=True)
    assert not is_released(release)

    state = merge_step(**_params(s3_bucket_url, tmp_path, 3).flow_parameters(), return_state=True)
    outcome = state.result()
    assert outcome.status == "published" and not outcome.cached
    runs = task_runs(flow_run_id(state), STAGE_TASKS)
    assert runs["check-checkpoint"][0].state.name == "Cached"  # same listing (the build checks its record again)
    assert {runs[n][0].state.name for n in ("model-release", *CHAIN_TASKS)} == {"Completed"}
    assert verify_folder(release).ok and read_manifest(release).attempt != attempt
    assert_release_of_step(release, template_run, 3)

    # a damaged release (a file gone, marker still there) is rebuilt too
    storage.remove(storage.join(release, "tokenizer.json"))
    again = merge_step(**_params(s3_bucket_url, tmp_path, 3).flow_parameters())
    assert again.status == "published" and verify_folder(release).ok
    assert_release_of_step(release, template_run, 3)
    assert json.loads(storage.read_text(storage.join(release, MARKER)))["attempt"] == read_manifest(release).attempt
