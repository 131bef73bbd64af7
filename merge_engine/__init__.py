"""stepmerge's engine: distributed training checkpoints -> exact Hugging Face models. No Prefect here.

Wings by purpose, each importing only from those below it (checked by ``tests/test_layers.py``):
``cli`` -> ``commands`` (merge, extract, combine, megatron_lora, split, reference_check), ``release``,
``validate`` -> ``output`` (jobs, shard jobs, executors, targets) -> ``plan`` (planner, plan records, Hub
format) -> ``layouts``, ``architectures``, ``lora`` -> ``formats`` (byte formats, tensor sources) ->
``storage``, ``errors``, ``devices`` (the ``--device`` a user names, checked), ``options`` (every user-facing
option, declared once: data only). The README's
layout section maps the modules.
"""

__version__ = "0.1.0"

OUTPUT_REVISION = 2
"""The revision of the bytes the engine writes, bumped whenever the output for the same input and options
changes while ``__version__`` stays (2: Qwen3-VL-MoE's fused experts in the Hub's layout, issue 16). Every
output fingerprint and pipeline cache key holds it (`engine_identity`) and ``stepmerge.json`` records it, so
an output or release of an older revision is never taken for the current one (it is rebuilt, or refused as
other input without ``overwrite``)."""


def engine_identity() -> dict[str, object]:
    """What of the engine decides the bytes it writes: its version and `OUTPUT_REVISION` (read at call
    time), for fingerprints and cache keys."""
    return {"engine": __version__, "output_revision": OUTPUT_REVISION}
