"""The validate tasks: a staged model or adapter folder -> a `ValidationReport` (the publish task stores it).

Runs `merge_engine.validate.validate_model`: keys and shapes against the config's model class,
index and paths, no NaN/inf, ``from_pretrained`` + a forward pass (GPU when present, else CPU), and
with a reference, values and logits compared. A failed check is a result, not an error: the record
says ``ok=False`` and the publish task refuses it. An output already released (found so by the merge, or published by
an earlier run since) returns the validation its release's manifest recorded, reading nothing
(`ReleaseState.recorded_validation`; ``state``: the release's state as the flow read it, else read here).
For a LoRA checkpoint (``checkpoint`` given, ``lora``) the fused model is also compared with the TRAINED
model, PEFT's own model of the run rebuilt from the checkpoint
(`merge_engine.validate.trained.check_against_trained`: ``trained_model``, ``trained_vs_fused``); a
mismatch fails the record, so nothing is published. With ``forward`` off it is reported skipped.
Not cached itself and persisting nothing: a stage nested in its output's chain (`flows.stages`), whose cache
key holds the validation settings and the listing of ``reference_url`` (a reference rewritten in place is a
new comparison).

`validate_adapter` does the same for an adapter (`merge_engine.validate.adapter.validate_adapter`: PEFT
loads it on its base, logits reproduce the released fused model's, allowing for the rounding of its
dtype); given the checkpoint, it also compares PEFT(base/ + adapter) with the trained model PEFT rebuilds
from the checkpoint: an adapter that is not the trained LoRA is not published. Its chain's key holds the
listing of ``fused_model_url``.
"""

from __future__ import annotations

from typing import Optional

from prefect import task
from prefect.cache_policies import NO_CACHE

from merge_engine.release.built import BuiltOutput
from merge_engine import storage
from merge_engine.release.state import ReleaseState, release_state, state_of
from merge_engine.validate import Check, ValidationReport, validate_model
from merge_engine.validate import adapter as adapter_validation
from merge_engine.validate.trained import TRAINED, VS_ADAPTER, VS_FUSED, check_against_trained
from tasks.checked import checked_checkpoint
from tasks.records import CheckpointRecord, StepRecord, ValidationSettings
from tasks.retry import RETRY_OPTIONS


def released_validation(output: BuiltOutput, release: Optional[str],
                        state: Optional[ReleaseState]) -> Optional[ValidationReport]:
    """The validation recorded in the release holding ``output`` when its bytes are there and no longer in
    staging (`ReleaseState.recorded_validation`); None when ``output`` is to be validated."""
    where = output.url if output.released else release
    if where is None:
        return None
    known = state_of(where, state)
    recorded = known.recorded_validation(output)
    if recorded is None and known is state and not output.released and not storage.exists(output.url):
        recorded = release_state(where).recorded_validation(output)  # published by another run since the flow read it
    return recorded


@task(name="validate-model", cache_policy=NO_CACHE, persist_result=False, **RETRY_OPTIONS)
def validate_output(output: BuiltOutput, settings: ValidationSettings, release: Optional[str] = None,
                    checkpoint: Optional[CheckpointRecord] = None, lora_alpha: Optional[float] = None,
                    config_url: Optional[str] = None, state: Optional[ReleaseState] = None,
                    step: Optional[StepRecord] = None) -> ValidationReport:
    """Validate the model folder ``output.url`` (staging) with ``settings`` (see the module docstring);
    ``checkpoint``, the check of ``step`` (with ``lora_alpha`` / ``config_url`` as the merge got them): the
    trained-model check."""
    recorded = released_validation(output, release, state)
    if recorded is not None:
        return recorded
    report = validate_model(output.url, settings.reference_url, forward=settings.forward, device=settings.device)
    return report.extended(trained_check(checkpoint, settings, step, fused_model_url=output.url,
                                         lora_alpha=lora_alpha, config_url=config_url))


@task(name="validate-adapter", cache_policy=NO_CACHE, persist_result=False, **RETRY_OPTIONS)
def validate_adapter(output: BuiltOutput, settings: ValidationSettings, fused_model_url: Optional[str] = None,
                     release: Optional[str] = None, checkpoint: Optional[CheckpointRecord] = None,
                     lora_alpha: Optional[float] = None, config_url: Optional[str] = None,
                     state: Optional[ReleaseState] = None, step: Optional[StepRecord] = None) -> ValidationReport:
    """Check the adapter: config, fits its base, finite, PEFT loads it; logits reproduce ``fused_model_url``'s;
    with ``checkpoint``, PEFT(base/ + adapter) reproduces the trained model (`trained_check`)."""
    recorded = released_validation(output, release, state)
    if recorded is not None:
        return recorded
    report = adapter_validation.validate_adapter(output.url, fused_model_url=fused_model_url,
                                                 forward=settings.forward, device=settings.device)
    return report.extended(trained_check(checkpoint, settings, step, adapter_url=output.url,
                                         lora_alpha=lora_alpha, config_url=config_url))


def trained_check(checkpoint: Optional[CheckpointRecord], settings: ValidationSettings,
                  step: Optional[StepRecord] = None, *,
                  fused_model_url: Optional[str] = None, adapter_url: Optional[str] = None,
                  lora_alpha: Optional[float] = None, config_url: Optional[str] = None) -> ValidationReport:
    """The trained-model check of a LoRA checkpoint's output (an empty report for other checkpoints); a cached
    ``checkpoint`` is checked again as the check of ``step`` (`tasks.checked`: ValueError without one)."""
    subject = fused_model_url or adapter_url or ""
    if checkpoint is None or not checkpoint.lora:
        return ValidationReport(subject)
    if not settings.forward:
        names = [name for name, url in ((VS_FUSED, fused_model_url), (VS_ADAPTER, adapter_url)) if url]
        return ValidationReport(subject, tuple(Check(name, True, "SKIPPED: forward passes are off (validate_forward)",
                                                     skipped=True) for name in [TRAINED] + names))
    if step is None and checkpoint.index is None:
        raise ValueError("a cached check record is checked again as the check of its step: pass the step")
    checked = checkpoint.to_checkpoint() if step is None else checked_checkpoint(checkpoint, step)
    return check_against_trained(checked, fused_model_url=fused_model_url, adapter_url=adapter_url,
                                 lora_alpha=lora_alpha, config_url=config_url, device=settings.device)
