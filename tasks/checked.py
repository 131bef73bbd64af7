"""A check record -> the engine's checkpoint, checked again when the record came from the result store.

`checked_checkpoint` is the one way a task turns a `tasks.records.CheckpointRecord` into the
`merge_engine.layouts.Checkpoint` it hands the engine:
- a record carrying its tensor index is this run's own check (an index never comes back from the result store:
  `tasks.result_records`): used as it is, nothing read;
- one without (served from the store, where another party may have written it) is checked again: the STEP it
  is the check of is checked, at the step's own URL and from the step's listing (never the URL or the files the
  record names), and the record must equal that check's record, field for field (its URL, files, layout,
  parallel sizes, LoRA facts, adapter folder...), else `ForgedRecord` naming the record's URL. A forged record
  cannot change how a step is merged, nor make a complete checkpoint nested inside the step (``actor/sub/``,
  verl's ``actor/huggingface/`` when it holds weights) the step's release;
- a record checked again is kept in this process (the last `KEPT` of them, keyed by the step's URL and
  everything the record states, its files' sizes and versions included): the run's other output and its
  trained-model checks take that check instead of reading the headers once more. Only this process writes it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Optional

from tasks.records import CheckpointRecord, StepRecord

if TYPE_CHECKING:
    from merge_engine.layouts.contract import Checkpoint

KEPT = 2  # records checked again that this process keeps (a step's outputs share one)

_checked_again: OrderedDict[str, Checkpoint] = OrderedDict()
_lock = threading.Lock()  # held while checking: a second build of the record waits and takes the first's check


def checked_checkpoint(record: CheckpointRecord, step: StepRecord, backend: Optional[str] = None) -> Checkpoint:
    """The engine's checkpoint of ``record``, the check of ``step`` (see the module docstring); ``backend`` is
    the one the check used. Raises `ForgedRecord` when the step's files say otherwise than ``record``."""
    if record.index is not None:
        return record.to_checkpoint()
    key = f"{step.url}\0{record.model_dump_json()}"
    with _lock:
        checkpoint = _checked_again.get(key)
        if checkpoint is None:
            checkpoint = _check_again(record, step, backend)
            _checked_again[key] = checkpoint
            while len(_checked_again) > KEPT:
                _checked_again.popitem(last=False)
        _checked_again.move_to_end(key)
    return checkpoint


def _check_again(record: CheckpointRecord, step: StepRecord, backend: Optional[str]) -> Checkpoint:
    from merge_engine.errors import ForgedRecord
    from merge_engine.layouts import check_checkpoint

    checkpoint = check_checkpoint(step.url, backend, step.listing())
    found = CheckpointRecord.from_checkpoint(checkpoint).model_dump()
    differ = sorted(name for name, value in record.model_dump().items() if found.get(name) != value)
    if differ:
        raise ForgedRecord(f"a cached check of step {step.url} states {', '.join(differ)} other than the step's "
                           f"files do (its check names {checkpoint.url}): not used", record.url)
    return checkpoint
