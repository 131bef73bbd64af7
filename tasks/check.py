"""The check task: a step the listing calls complete, confirmed by its layout's deep check.

Cached on the step's listing fingerprint (+ backend, engine version): a re-run whose outputs are all
cached reads nothing. The record is stored without its tensor index (`tasks.result_records`); one served from
the cache must be of this step's places and listing (`check_current`; else the step is checked again under the
key's next generation), and is checked again, once per run, by the first task that needs it (`tasks.checked`).
An incomplete step
is refused with `IncompleteCheckpoint`, a broken one with `CorruptShard` / `WorldSizeMismatch`:
named errors, so the task fails at once and is not retried. The layout is whatever the engine
detects (FSDP, Megatron, Hugging Face): the task does not care.
"""

from __future__ import annotations

from typing import Any, Optional

from prefect import task

from merge_engine.errors import IncompleteCheckpoint, WorldSizeMismatch
from merge_engine.layouts import check_checkpoint
from tasks.cache import stage_cache_policy
from tasks.records import CheckpointRecord, StepRecord, of_type
from tasks.result_records import RECORD_SERIALIZER
from tasks.retry import RETRY_OPTIONS


def check_current(record: CheckpointRecord, inputs: dict[str, Any]) -> bool:
    """May a stored check record be this step's check (`CheckpointRecord.verified_for` the task's ``step``)?
    A record of another type, or naming another place, is `UnsafeRecord`: the cache logs it and checks the step
    again under the next generation of its key (`tasks.cache.live_generation`), so a refused record never
    blocks its step."""
    step: StepRecord = inputs["step"]
    of_type(record, CheckpointRecord, step.url).verified_for(step)
    return True


@task(name="check-checkpoint", cache_policy=stage_cache_policy("check", ("step", "backend"), still_valid=check_current),
      persist_result=True, result_serializer=RECORD_SERIALIZER, **RETRY_OPTIONS)
def check_step(step: StepRecord, backend: Optional[str] = None) -> CheckpointRecord:
    """The checkpoint of ``step`` after the deep completeness check (headers only, no weights), of the listing
    discovery made (not listed again), with what the check learned: LoRA or not, the parsed tensor index."""
    if step.status == "invalid":
        raise WorldSizeMismatch(step.reason, step.url)
    if not step.complete:
        raise IncompleteCheckpoint(step.reason or "not complete yet", step.url)
    return CheckpointRecord.from_checkpoint(check_checkpoint(step.url, backend, step.listing()))
