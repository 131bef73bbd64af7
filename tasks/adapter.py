"""The adapter tasks: a LoRA checkpoint -> a PEFT adapter folder in staging, and its validation.

- `extract_adapter` wraps `merge_engine.commands.extract.extract_lora` the way `tasks.merge` wraps
  the merge: cached on the step's and checkpoint's listing fingerprints + options (with the
  listings of ``hf_model_path`` and ``base_model``) + release + engine version; an adapter already
  released with the engine's fingerprint of this extraction (`merge_engine.commands.extract.extract_fingerprint`:
  the one fingerprint, also in its ``stepmerge.json``) is not extracted again (``released=True``); one
  released from something else is refused at once without ``overwrite``.
- `validate_adapter` runs `merge_engine.validate.adapter.validate_adapter` (PEFT loads it on its base, logits
  reproduce the released fused model's, allowing for the rounding of its dtype) and returns a
  `ValidationRecord`; a released adapter returns the validation its manifest recorded, reading nothing.
  Given the checkpoint, it also compares PEFT(base/ + adapter) with the trained model PEFT rebuilds from
  the checkpoint (`merge_engine.validate.trained`): an adapter that is not the trained LoRA is not published.
- Where the shard jobs of the adapter (and of the clean base under ``base/``) run (``execution``, never
  part of the cache key: it changes no byte): as the merge task's (`tasks.shard_runs.task_executor_address`),
  Prefect task runs on a Ray cluster when a Ray address is configured (the flow parameter, else
  ``STEPMERGE_RAY_ADDRESS``), else ``workers`` threads of this process.
Retries: transient storage faults only.
"""

from __future__ import annotations

import time
import uuid
from typing import Optional

from prefect import task

from merge_engine import storage
from merge_engine.lora.adapter_io import point_adapter_at_base
from merge_engine.validate import adapter as adapter_validation
from merge_engine.validate.adapter import BASE_DIR
from merge_engine.output.executors import executor_at
from merge_engine.release.state import ADAPTER, staging_url, sweep_stale_staging
from tasks.cache import stage_cache_policy
from tasks.merge import output_available, released_output
from tasks.progress import ProgressArtifact, release_artifact_key
from tasks.records import (
    AdapterSettings,
    CheckpointRecord,
    ExecutionSettings,
    OutputRecord,
    StepRecord,
    ValidationRecord,
    ValidationSettings,
)
from tasks.retry import RETRY_OPTIONS
from tasks.shard_runs import task_executor_address
from tasks.validate import already_released, recorded_validation, trained_check


@task(name="extract-adapter",
      cache_policy=stage_cache_policy("extract", ("step.fingerprint", "checkpoint", "settings", "release"),
                                      still_valid=output_available,
                                      listed=("settings.hf_model_path", "settings.base_model")),
      persist_result=True, **RETRY_OPTIONS)
def extract_adapter(step: StepRecord, checkpoint: CheckpointRecord, settings: AdapterSettings, release: str,
                    staging_root: Optional[str] = None, overwrite: bool = False,
                    execution: Optional[ExecutionSettings] = None) -> OutputRecord:
    """Extract the PEFT adapter of ``checkpoint`` into staging for ``release`` (or find it released);
    its shard jobs run where ``execution`` says (as the merge task's: `tasks.shard_runs.task_executor_address`)."""
    from merge_engine.commands.extract import extract_fingerprint, extract_lora

    fingerprint = extract_fingerprint(checkpoint.to_checkpoint(), settings.to_options())
    found = released_output(ADAPTER, checkpoint.url, release, fingerprint, overwrite, checkpoint.fingerprint,
                            settings.model_dump(include={"dtype", "max_shard_size", "hf_model_path", "lora_alpha",
                                                         "weights_format"}))
    if found is not None:
        return found
    target = staging_url(staging_root, release, fingerprint)
    sweep_stale_staging(staging_root, keep=target)
    progress = ProgressArtifact(release_artifact_key("progress", release),
                                f"Extracting the adapter of {checkpoint.url}")
    execution = execution or ExecutionSettings()
    executor = executor_at(task_executor_address(execution.workers, execution.ray_address))
    result = extract_lora(checkpoint.url, target, settings.to_options(overwrite=True),
                          on_bytes=progress.on_bytes, on_plan=progress.on_plan, checkpoint=checkpoint.to_checkpoint(),
                          executor=executor)
    progress.finish()
    if settings.include_base and storage.list_files(storage.join(target, BASE_DIR)):
        point_adapter_at_base(target, storage.join(release, BASE_DIR))
    return OutputRecord(kind=ADAPTER, source_url=checkpoint.url, url=target, fingerprint=result.fingerprint,
                        release=release, attempt=uuid.uuid4().hex, layout=checkpoint.layout,
                        tensors=result.tensors, tensor_bytes=result.tensor_bytes,
                        files=len(result.files), total_bytes=sum(size for _, size in result.files),
                        seconds=result.seconds, notes=tuple(result.notes), checksums=tuple(result.checksums))


@task(name="validate-adapter",
      cache_policy=stage_cache_policy("validate-adapter", ("output.fingerprint", "output.url", "output.attempt",
                                                           "settings", "fused_model_url"),
                                      listed=("fused_model_url",)),
      persist_result=True, **RETRY_OPTIONS)
def validate_adapter(output: OutputRecord, settings: ValidationSettings, fused_model_url: Optional[str] = None,
                     release: Optional[str] = None, checkpoint: Optional[CheckpointRecord] = None,
                     lora_alpha: Optional[float] = None, config_url: Optional[str] = None) -> ValidationRecord:
    """Check the adapter: config, fits its base, finite, PEFT loads it; logits reproduce ``fused_model_url``'s;
    with ``checkpoint``, PEFT(base/ + adapter) reproduces the trained model (`tasks.validate.trained_check`)."""
    released = already_released(output, release)
    if released is not None:
        return recorded_validation(released)
    started = time.perf_counter()
    report = adapter_validation.validate_adapter(output.url, fused_model_url=fused_model_url,
                                                 forward=settings.forward, device=settings.device)
    report = report.extended(trained_check(checkpoint, settings, adapter_url=output.url, lora_alpha=lora_alpha,
                                           config_url=config_url))
    return ValidationRecord.from_report(report, seconds=time.perf_counter() - started)
