"""The validate task: a staged model folder -> a `ValidationRecord` (the publish task stores it).

Runs `merge_engine.validate.validate_model`: keys and shapes against the config's model class,
index and paths, no NaN/inf, ``from_pretrained`` + a forward pass (GPU when present, else CPU), and
with a reference, values and logits compared. A failed check is a result, not an error: the record
says ``ok=False`` and the publish task refuses it. An output already released (found so by the merge, or published by
an earlier run since) returns the validation its release's manifest recorded, reading nothing.
For a LoRA checkpoint (``checkpoint`` given, ``lora``) the fused model is also compared with the TRAINED
model, PEFT's own model of the run rebuilt from the checkpoint
(`merge_engine.validate.trained.check_against_trained`: ``trained_model``, ``trained_vs_fused``); a
mismatch fails the record, so nothing is published. With ``forward`` off it is reported skipped.
Cached on the output (its fingerprint and the attempt that produced it: rebuilt bytes are
validated again) + settings, with the listing of ``reference_url`` (a reference rewritten in place
is a new comparison).
"""

from __future__ import annotations

import time
from typing import Optional

from prefect import task

from merge_engine import storage
from merge_engine.release.state import release_state
from merge_engine.validate import Check, ValidationReport, validate_model
from merge_engine.validate.trained import TRAINED, VS_ADAPTER, VS_FUSED, check_against_trained
from tasks.cache import stage_cache_policy
from tasks.records import CheckpointRecord, OutputRecord, ValidationRecord, ValidationSettings
from tasks.retry import RETRY_OPTIONS


def recorded_validation(release: str) -> ValidationRecord:
    """The validation the manifest of ``release`` recorded (for outputs that are already released)."""
    manifest = release_state(release).manifest
    recorded = dict(manifest.validation or {}) if manifest is not None else {}
    if not recorded:
        return ValidationRecord(model_url=release, ok=False, summary="no validation recorded in the manifest")
    return ValidationRecord(model_url=recorded.get("model_url", release), ok=bool(recorded.get("ok")),
                            summary=str(recorded.get("summary", "")), checks=tuple(recorded.get("checks", ())),
                            reference_url=recorded.get("reference_url"))


def already_released(output: OutputRecord, release: Optional[str]) -> Optional[str]:
    """The release URL holding ``output`` when its bytes are there and no longer in staging; else None.

    (An output found released at merge time, or one whose staging folder is gone because a run
    before this one published it.)
    """
    if output.released:
        return output.url
    if release is not None and not storage.exists(output.url) and release_state(release).holds(output.fingerprint):
        return release
    return None


@task(name="validate-model",
      cache_policy=stage_cache_policy("validate", ("output.fingerprint", "output.url", "output.attempt", "settings"),
                                      listed=("settings.reference_url",)),
      persist_result=True, **RETRY_OPTIONS)
def validate_output(output: OutputRecord, settings: ValidationSettings, release: Optional[str] = None,
                    checkpoint: Optional[CheckpointRecord] = None, lora_alpha: Optional[float] = None,
                    config_url: Optional[str] = None) -> ValidationRecord:
    """Validate the model folder ``output.url`` (staging) with ``settings`` (see the module docstring);
    ``checkpoint`` (with ``lora_alpha`` / ``config_url`` as the merge got them): the trained-model check."""
    released = already_released(output, release)
    if released is not None:
        return recorded_validation(released)
    started = time.perf_counter()
    report = validate_model(output.url, settings.reference_url, forward=settings.forward, device=settings.device)
    report = report.extended(trained_check(checkpoint, settings, fused_model_url=output.url, lora_alpha=lora_alpha,
                                           config_url=config_url))
    return ValidationRecord.from_report(report, seconds=time.perf_counter() - started)


def trained_check(checkpoint: Optional[CheckpointRecord], settings: ValidationSettings, *,
                  fused_model_url: Optional[str] = None, adapter_url: Optional[str] = None,
                  lora_alpha: Optional[float] = None, config_url: Optional[str] = None) -> ValidationReport:
    """The trained-model check of a LoRA checkpoint's output (an empty report for other checkpoints)."""
    subject = fused_model_url or adapter_url or ""
    if checkpoint is None or not checkpoint.lora:
        return ValidationReport(subject)
    if not settings.forward:
        names = [name for name, url in ((VS_FUSED, fused_model_url), (VS_ADAPTER, adapter_url)) if url]
        return ValidationReport(subject, tuple(Check(name, True, "SKIPPED: forward passes are off (validate_forward)",
                                                     skipped=True) for name in [TRAINED] + names))
    return check_against_trained(checkpoint.to_checkpoint(), fused_model_url=fused_model_url, adapter_url=adapter_url,
                                 lora_alpha=lora_alpha, config_url=config_url, device=settings.device)
