"""The validate task: a staged model folder -> a `ValidationRecord` (the publish task stores it).

Runs `merge_engine.validate.validate_model`: keys and shapes against the config's model class,
index and paths, no NaN/inf, ``from_pretrained`` + a forward pass (GPU when present, else CPU), and
with a reference, values and logits compared. A failed check is a result, not an error: the record
says ``ok=False`` and the publish task refuses it. An output already released (found so by the merge, or published by
an earlier run since) returns the validation its release's manifest recorded, reading nothing.
Cached on the output (its fingerprint and the attempt that produced it: rebuilt bytes are
validated again) + settings, with the listing of ``reference_url`` (a reference rewritten in place
is a new comparison).
"""

from __future__ import annotations

import time
from typing import Optional

from prefect import task

from merge_engine import storage
from merge_engine.release import release_state
from merge_engine.validate import validate_model
from tasks.cache import stage_cache_policy
from tasks.records import OutputRecord, ValidationRecord, ValidationSettings
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
def validate_output(output: OutputRecord, settings: ValidationSettings, release: Optional[str] = None
                    ) -> ValidationRecord:
    """Validate the model folder ``output.url`` (staging) with ``settings`` (see the module docstring)."""
    released = already_released(output, release)
    if released is not None:
        return recorded_validation(released)
    started = time.perf_counter()
    report = validate_model(output.url, settings.reference_url, forward=settings.forward, device=settings.device)
    return ValidationRecord.from_report(report, seconds=time.perf_counter() - started)
