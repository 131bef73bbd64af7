"""Cache keys of the stage tasks: what a stage's output depends on, and whether that output still exists.

Contract:
- A key is ``stepmerge-<stage>-<sha256>`` of: the stage name, `PIPELINE_VERSION`, the engine
  version and output revision (`merge_engine.engine_identity`) and the stage's inputs as the task receives them. The
  inputs are records that carry the source's fingerprint from a listing (names, sizes,
  ETags/generations/mtimes) and the options, so a re-run of an unchanged step computes the same
  key from a listing alone, and any change to a file, an option or the engine gives a new key.
- Only the inputs named in ``fields`` count (``"output.fingerprint"`` names an attribute of an
  input), so timings, progress hooks and the like never change a key. Values are hashed as
  canonical JSON, so keys are stable across processes and machines (no pickles, no object ids).
- Inputs named in ``listed`` are URLs of folders whose CONTENT decides the output (a replacement
  config folder, a reference model, a base model): the key holds their listing's fingerprint
  (names, sizes, versions), so the same URL with new files is a new key. One listing per folder, by the
  `InputFolders` the caller passes the task as its parameter named ``folders_parameter`` (``folders``): the key
  lists each folder into it, and the body, given the same object, reads by the very listing its key holds and
  lists nothing again. Nothing is handed over outside the task's own parameters.
- A cached result whose OUTPUT no longer exists is not trusted (``still_valid(result, inputs)``: e.g. the
  release it describes was deleted; it is given the task's inputs, so it can ask the release state the
  flow passed the task instead of reading the release once per generation). The key then moves on to the next GENERATION, ``<key>-g1``, ``-g2``...:
  the first generation that is free, or whose result is still valid, is the key. Every run walks
  the same chain, so two runs racing to rebuild a deleted release agree on the key and the
  isolation below makes one wait for the other, instead of both recomputing (which
  ``refresh_cache`` would do: it skips the cache lookup made under the lock).
- Only a result store that reads through a guarded block (`tasks.results.reads_only_records`) gets a key: a
  stage task run with any other storage (Prefect's default folder, in a flow of its own) runs uncached, and
  reads no record that could name a pickle.
- SERIALIZABLE isolation with `CrashSafeFileLockManager`: two runs of the same stage with the same
  key do not both compute; the second waits for the first's lock and reads its result.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

from prefect.cache_policies import CacheKeyFnPolicy
from pydantic import BaseModel

import merge_engine
from tasks.locking import CrashSafeFileLockManager
from tasks.results import reads_only_records

if TYPE_CHECKING:
    from merge_engine.commands.input_folders import InputFolders

logger = logging.getLogger(__name__)

PIPELINE_VERSION = "1"  # bump when a task's output changes for the same inputs
MAX_GENERATIONS = 1000

LOCKS = CrashSafeFileLockManager()
FOLDERS_PARAMETER = "folders"  # the parameter of a task with ``listed`` folders that holds their `InputFolders`


def _canonical(value: Any) -> Any:
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _canonical(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (list, tuple)):
        return [_canonical(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _canonical(v) for k, v in value.items()}
    return value


def _field(inputs: dict[str, Any], name: str) -> Any:
    """``inputs["a"]``, or for ``"a.b"`` the attribute (or item) ``b`` of it."""
    head, *rest = name.split(".")
    value = inputs.get(head)
    for part in rest:
        value = value.get(part) if isinstance(value, dict) else getattr(value, part, None)
    return value


def stage_key(stage: str, inputs: dict[str, Any], fields: Sequence[str], listed: Sequence[str] = (),
              folders: Optional[InputFolders] = None) -> str:
    """The (generation 0) cache key of ``stage`` for these task inputs (only ``fields`` count, and the
    listings of the URLs named in ``listed``, taken by ``folders``: a new `InputFolders` when None)."""
    payload = {
        "stage": stage,
        "pipeline": PIPELINE_VERSION,
        **merge_engine.engine_identity(),
        "inputs": {name: _canonical(_field(inputs, name)) for name in fields},
    }
    if listed:
        from merge_engine.commands.input_folders import InputFolders

        folders = folders if folders is not None else InputFolders()
        urls = {name: _field(inputs, name) for name in listed}
        payload["listings"] = {name: folders.digest(str(url), recursive=True) if url else None
                               for name, url in urls.items()}
    digest = hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()
    return f"stepmerge-{stage}-{digest[:48]}"


def generation_key(key: str, generation: int) -> str:
    return key if generation == 0 else f"{key}-g{generation}"


def live_generation(store: Any, key: str, still_valid: Callable[[Any, dict[str, Any]], bool],
                    inputs: dict[str, Any]) -> str:
    """The first generation of ``key`` with no record in ``store``, or with a still-valid result (for the
    task's ``inputs``)."""
    for generation in range(MAX_GENERATIONS):
        candidate = generation_key(key, generation)
        if not store.exists(candidate):
            return candidate
        try:
            value = store.read(candidate).result
        except Exception as exc:  # noqa: BLE001 - an unreadable record is no cache: move on
            logger.warning("cached result %s unreadable (%s); not used", candidate, exc)
            continue
        try:
            if still_valid(value, inputs):
                return candidate
        except Exception as exc:  # noqa: BLE001 - cannot tell: do not trust it
            logger.warning("could not check the output of cached result %s (%s); not used", candidate, exc)
            continue
        logger.info("cached result %s describes an output that is gone; using the next generation", candidate)
    raise RuntimeError(f"{MAX_GENERATIONS} generations of {key} are all stale")


@dataclass
class StageCachePolicy(CacheKeyFnPolicy):
    """`CacheKeyFnPolicy` + output validation by generations (see the module docstring)."""

    still_valid: Optional[Callable[[Any, dict[str, Any]], bool]] = None

    def compute_key(self, task_ctx: Any, inputs: dict[str, Any], flow_parameters: dict[str, Any],
                    **kwargs: Any) -> Optional[str]:
        store = getattr(task_ctx, "result_store", None)
        if not reads_only_records(store):
            # a store Prefect reads with the serializer each record names (its default local folder, a block
            # not made by tasks.results): no key, so no record is read (nor written); the task runs
            logger.warning("%s: result storage %s is not guarded (tasks.results); the task runs uncached",
                           getattr(getattr(task_ctx, "task", None), "name", "a stage task"),
                           type(getattr(store, "result_storage", None)).__name__)
            return None
        key = super().compute_key(task_ctx, inputs, flow_parameters, **kwargs)
        if key is None or self.still_valid is None or store is None:
            return key
        return live_generation(store, key, self.still_valid, inputs)


def _key_fn(stage: str, fields: Sequence[str], listed: Sequence[str],
            folders_parameter: str) -> Callable[[Any, dict[str, Any]], str]:
    def cache_key(context: Any, inputs: dict[str, Any]) -> str:
        if not listed:
            return stage_key(stage, inputs, fields)
        from merge_engine.commands.input_folders import InputFolders

        folders = inputs.get(folders_parameter)
        if folders is not None and not isinstance(folders, InputFolders):
            raise TypeError(f"{stage}: the task's {folders_parameter!r} is a {type(folders).__name__}, "
                            "not the InputFolders its key lists into")
        return stage_key(stage, inputs, fields, listed, folders)  # the listings land in the task's own parameter

    cache_key.__name__ = f"{stage}_cache_key"
    return cache_key


def stage_cache_policy(stage: str, fields: Sequence[str],
                       still_valid: Optional[Callable[[Any, dict[str, Any]], bool]] = None,
                       listed: Sequence[str] = (), folders_parameter: str = FOLDERS_PARAMETER) -> StageCachePolicy:
    """The policy of one stage task: key from ``fields`` (and the listings of ``listed`` URLs, taken into the task's
    `InputFolders` parameter ``folders_parameter``, which no key reads otherwise; a fresh one when the task was given
    None), generations by ``still_valid``, serialised per key."""
    return StageCachePolicy(cache_key_fn=_key_fn(stage, tuple(fields), tuple(listed), folders_parameter),
                            still_valid=still_valid, isolation_level="SERIALIZABLE", lock_manager=LOCKS)
