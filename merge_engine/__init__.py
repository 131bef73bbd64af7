"""stepmerge's engine: distributed training checkpoints -> exact Hugging Face models. No Prefect here.

The engine is built in wings by purpose, one folder (or top-level module) each, and `WINGS` is their one
written order, bottom to top: a module imports only from its own wing and the wings below it, never from
one above, and no imports form a cycle (``tests/test_layers.py`` reads `WINGS` and checks every import).
A record two wings need lives in the lower one; a dispatcher lives above what it dispatches to. The
README's layout section maps the modules of each wing.

The package exports the Python API (`merge_engine.api`, docs/python.md): `merge`, `extract_lora`, `merge_lora`,
`check`, `verify`, `publish`. Importing it imports no torch: each function imports what it runs.
"""

__version__ = "0.1.0"

WINGS = (
    "merge_engine.errors",          # the named errors users see
    "merge_engine.option_values",   # the spellings users type for option values (sizes, dtypes, formats)
    "merge_engine.options",         # every user-facing option and kind of value declared once (data only)
    "merge_engine.devices",         # the torch device a user names, checked
    "merge_engine.versions",        # the tested ranges of transformers, peft and torch
    "merge_engine.storage",         # any URL: backends, listings, ranged reads, atomic writes, guarded JSON
    "merge_engine.formats",         # byte formats read lazily and safely; tensor sources
    "merge_engine.plan",            # the plan records (MergePlan, output heads) and the Hub's format
    "merge_engine.architectures",   # declarative Megatron <-> HF tables; the Megatron plan
    "merge_engine.layouts",         # one module per on-disk checkpoint format; runs; discovery
    "merge_engine.lora",            # the LoRA library: keys, PEFT config, fuse, SVD; the trained model's plan
    "merge_engine.planner",         # picks a checkpoint's plan: dispatches to architectures, lora and plan
    "merge_engine.output",          # OutputJob, work units, executors, targets, local commit
    "merge_engine.validate",        # structure, compare, forward, the trained model
    "merge_engine.release",         # release state, publish, verify, checksums
    "merge_engine.commands",        # the jobs: merge, extract, combine, split, reference_check
    "merge_engine.api",             # the Python API the package exports (thin calls into commands and release)
    "merge_engine.cli",             # `python -m merge_engine ...`
    "merge_engine.__main__",
    "synthetic_runs",               # checkpoints written by the real trainers' code; the storage servers (demo, tests)
    "tasks",                        # Prefect tasks (above the engine)
    "flows",                        # Prefect flows
    "deployments",                  # what runs them
)
"""The wings of the house, bottom to top (see the module docstring). The package itself (this module) is
below them all and imports none of them but the API it exports (`merge_engine.api`, whose functions import
the wings they call when they run)."""

OUTPUT_REVISION = 3
"""The revision of the bytes the engine writes, bumped whenever the output for the same input and options
changes while ``__version__`` stays (2: Qwen3-VL-MoE's fused experts in the Hub's layout; 3: an untied masked-LM
head's bias written as transformers 4.x reads it, and the adapter release of an adapter-only step given a base
model carries that base in ``base/``). Every
output fingerprint and pipeline cache key holds it (`engine_identity`) and ``stepmerge.json`` records it, so
an output or release of an older revision is never taken for the current one (it is rebuilt, or refused as
other input without ``overwrite``)."""


def engine_identity() -> dict[str, object]:
    """What of the engine decides the bytes it writes: its version and `OUTPUT_REVISION` (read at call
    time), for fingerprints and cache keys."""
    return {"engine": __version__, "output_revision": OUTPUT_REVISION}


from merge_engine.api import check, extract_lora, merge, merge_lora, publish, verify  # noqa: E402 - after __version__

__all__ = ["OUTPUT_REVISION", "WINGS", "__version__", "check", "engine_identity", "extract_lora", "merge", "merge_lora",
           "publish", "verify"]
