"""Prefect tasks, one per stage, thin over `merge_engine`: they choose the cache key and the retry rule.

    discover_steps / discover_step / find_published     listings (never cached, always fresh)
    check_step        deep completeness check            cached on the step's listing fingerprint
    build_output      checkpoint -> staged output        shown as merge_model ("merge-model": the HF folder)
                      and extract_adapter ("extract-adapter": the PEFT adapter), one body over a
                      `tasks.build.BuildSpec`
    validate_output / validate_adapter                   the staged output checked
    publish_release   staging -> release + manifest + marker

The build, validate and publish tasks are not cached and persist nothing: they run nested in their output's
chain (`flows.stages.release_chain`), the one task cached per output (on listing + settings + release +
engine, `tasks.cache`).

Each task is a decorator, a cache key (`tasks.cache`) and a question to the release's state
(`merge_engine.release.state.ReleaseState`); the work itself is the engine's.
Records in: settings and checkpoint records (`tasks.records`); out: the engine's own types
(`BuiltOutput`, `ValidationReport`, `Release`), never tensors. Retries: transient storage faults only
(`tasks.retry`). Result storage: local by default, S3/GCS when configured (`tasks.results`).
Importing ``tasks`` (or a light module of it: `tasks.discover`, `tasks.records`, `tasks.progress`)
imports no torch: each task below is imported from its module on first use (PEP 562), so the
listings-only watcher (`flows.merge_new_steps` on a deployment) runs without torch or transformers.
"""

import importlib
from typing import Any

# task name -> the module that defines it
TASK_MODULES = {
    "discover_steps": "tasks.discover", "discover_step": "tasks.discover", "find_published": "tasks.discover",
    "check_step": "tasks.check", "build_output": "tasks.build", "merge_model": "tasks.build",
    "extract_adapter": "tasks.build", "validate_output": "tasks.validate", "validate_adapter": "tasks.validate",
    "publish_release": "tasks.publish",
}

__all__ = list(TASK_MODULES)


def __getattr__(name: str) -> Any:
    """``tasks.merge_model`` and ``from tasks import merge_model``: the task, its module imported now."""
    if name not in TASK_MODULES:
        raise AttributeError(f"module 'tasks' has no attribute {name!r}")
    return getattr(importlib.import_module(TASK_MODULES[name]), name)
