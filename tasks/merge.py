"""The merge task: a checked checkpoint -> a Hugging Face folder in (local) staging.

- Cache key: the checkpoint's listing fingerprint, the output options (and the listing of
  ``hf_model_path``: its content, not its name, shapes the output), the release it is for, the
  engine version (`tasks.cache`). Same key -> Prefect returns the record, nothing is read; unless
  the output it describes is gone (`output_available`: neither in staging nor released), then the
  next cache generation is used and the merge runs again.
- Not in the cache but already released: when the release already holds this exact merge
  (`merge_engine.commands.merge.merge_fingerprint`), nothing is merged; the record points at the release
  (``released=True``). The release is the truth, the cache an accelerator.
- A release built from something else (the step was rewritten since, or other options) without
  ``overwrite``: `TargetExists` at once, before a byte is read or staged (publishing would refuse
  it anyway, after the whole merge).
- Otherwise `merge_engine.commands.merge.merge_checkpoint` writes the staging folder (atomically; a finished
  staging folder of the same merge is reused), with a progress artifact moving as bytes are written.
  It merges the checkpoint the check task checked (no second completeness check). A LoRA checkpoint
  gives the TRAINED model (adapters fused), as the engine defines it. Staging folders left by
  crashed runs are swept first (`merge_engine.release.state.sweep_stale_staging`).
- Where the shard jobs run (``execution``, never part of the cache key: it changes no byte): Prefect
  task runs on a Ray cluster when a Ray address is configured (the flow's ``ray_address``, else
  ``STEPMERGE_RAY_ADDRESS`` in the worker's environment; `tasks.shard_runs`), else ``workers`` threads
  here (None: one per core). The record carries the shard jobs' sha256 of every weight file and index
  (``checksums``): publishing checks the bytes it copies against them.
- Retries: transient storage faults only; named errors (corrupt shard, ...) fail at once.
"""

from __future__ import annotations

import dataclasses
import uuid
from typing import Optional

from prefect import task

from merge_engine import storage
from merge_engine.commands.merge import merge_checkpoint, merge_fingerprint, read_provenance
from merge_engine.output.executors import executor_at
from merge_engine.release.state import MODEL, release_state, staging_url, sweep_stale_staging
from tasks.cache import stage_cache_policy
from tasks.progress import ProgressArtifact, release_artifact_key
from tasks.records import CheckpointRecord, ExecutionSettings, MergeSettings, OutputRecord
from tasks.retry import RETRY_OPTIONS
from tasks.shard_runs import task_executor_address


def output_available(output: OutputRecord) -> bool:
    """Is a cached output still somewhere: its staging folder, or its release (holding its fingerprint)?"""
    if not output.released and storage.list_files(output.url):
        return True
    release = output.url if output.released else output.release
    return bool(release) and release_state(release).holds(output.fingerprint)


def released_output(kind: str, source_url: str, release: str, fingerprint: str,
                    overwrite: bool = False, checkpoint_fingerprint: Optional[str] = None,
                    settings: Optional[dict] = None) -> Optional[OutputRecord]:
    """The record of an output already released at ``release`` from ``fingerprint``; else None.

    Raises `TargetExists` when ``release`` is whole but built from another fingerprint and not ``overwrite``:
    naming the differing options when the release is of the same checkpoint (``checkpoint_fingerprint``,
    ``settings`` as this build records them), else offering ``overwrite``.
    """
    state = release_state(release)
    state.refuse_other(fingerprint, overwrite, kind, checkpoint_fingerprint, settings)
    if not state.holds(fingerprint) or state.manifest is None:
        return None
    provenance = read_provenance(release) or {}
    return OutputRecord(kind=kind, source_url=source_url, url=release, fingerprint=fingerprint, release=release,
                        attempt=uuid.uuid4().hex, layout=str(provenance.get("layout", "")),
                        tensors=int(provenance.get("tensors", 0)),
                        tensor_bytes=int(provenance.get("tensor_bytes", 0)), files=len(state.manifest.files),
                        total_bytes=state.manifest.total_bytes, released=True)


@task(name="merge-model",
      cache_policy=stage_cache_policy("merge", ("checkpoint", "settings", "release"), still_valid=output_available,
                                      listed=("settings.hf_model_path",)),
      persist_result=True, **RETRY_OPTIONS)
def merge_model(checkpoint: CheckpointRecord, settings: MergeSettings, release: str,
                staging_root: Optional[str] = None, overwrite: bool = False,
                execution: Optional[ExecutionSettings] = None) -> OutputRecord:
    """Merge ``checkpoint`` into a staging folder for ``release`` (or find it already released)."""
    fingerprint = merge_fingerprint(checkpoint.to_checkpoint(), settings.to_options())
    found = released_output(MODEL, checkpoint.url, release, fingerprint, overwrite, checkpoint.fingerprint,
                            settings.model_dump(include={"dtype", "max_shard_size", "hf_model_path", "lora_alpha",
                                                         "weights_format"}))
    if found is not None:
        return found
    target = staging_url(staging_root, release, fingerprint)
    sweep_stale_staging(staging_root, keep=target)
    progress = ProgressArtifact(release_artifact_key("progress", release), f"Merging {checkpoint.url} -> {release}")
    options = dataclasses.replace(settings.to_options(), overwrite=True)  # staging is ours to replace
    execution = execution or ExecutionSettings()
    executor = executor_at(task_executor_address(execution.workers, execution.ray_address))
    result = merge_checkpoint(checkpoint.url, target, options, on_bytes=progress.on_bytes, on_plan=progress.on_plan,
                              checkpoint=checkpoint.to_checkpoint(), executor=executor)
    progress.finish()
    return OutputRecord(kind=MODEL, source_url=checkpoint.url, url=target, fingerprint=result.fingerprint,
                        release=release, attempt=uuid.uuid4().hex, layout=result.layout, tensors=result.tensors,
                        tensor_bytes=result.tensor_bytes,
                        files=len(result.files), total_bytes=sum(size for _, size in result.files),
                        seconds=result.seconds, notes=tuple(result.notes), checksums=tuple(result.checksums))
