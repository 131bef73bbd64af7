"""Prefect tasks, one per stage, thin over `merge_engine`: they choose the cache key and the retry rule.

    discover_steps / discover_step / find_published     listings (never cached, always fresh)
    check_step        deep completeness check            cached on the step's listing fingerprint
    merge_model       checkpoint -> staged HF folder     cached on fingerprint + options + engine
    extract_adapter   LoRA checkpoint -> staged adapter  cached likewise
    validate_output / validate_adapter                   cached on the output's fingerprint + settings
    publish_release   staging -> release + manifest + marker

Each task is a decorator, a cache key (`tasks.cache`) and a release-state check over the engine's
records (`merge_engine.release`); the work itself is the engine's.
Records in and out (`tasks.records`), never tensors. Retries: transient storage faults only
(`tasks.retry`). Result storage: local by default, S3/GCS when configured (`tasks.results`).
"""

from tasks.adapter import extract_adapter, validate_adapter
from tasks.check import check_step
from tasks.discover import discover_step, discover_steps, find_published
from tasks.merge import merge_model
from tasks.publish import publish_release
from tasks.validate import validate_output

__all__ = [
    "discover_steps", "discover_step", "find_published", "check_step", "merge_model", "extract_adapter",
    "validate_output", "validate_adapter", "publish_release",
]
