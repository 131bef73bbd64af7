"""verl's ``test``: does a checkpoint, merged, equal a reference Hugging Face folder?

The checkpoint is planned exactly as `merge` would plan it and its tensors are streamed next to
the reference's, chunk against chunk: nothing is written and neither model is held in memory.
The comparison is validation's one comparison (`merge_engine.validate.compare.compare_tensors`:
the same keys, shapes and dtypes, values within ``atol + rtol * |reference|``, default
`WEIGHT_TOLERANCE`); the report names the first failing key and the largest difference.
"""

from __future__ import annotations

from merge_engine.formats.hf_metadata import read_config
from merge_engine.layouts import check_checkpoint, open_checkpoint
from merge_engine.commands.merge import MergeOptions, plan_merge
from merge_engine.plan.merge_plan import MergePlan
from merge_engine.formats.tensor_source import DEFAULT_CHUNK_BYTES, TensorSource
from merge_engine.validate import Check, ValidationReport
from merge_engine.output.shard_job import tensor_chunks
from merge_engine.validate.compare import WEIGHT_TOLERANCE, TensorSide, Tolerance, compare_tensors


def compare_plan_to_reference(plan: MergePlan, source: TensorSource, reference: TensorSource, *,
                              atol: float, rtol: float, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> list[Check]:
    """Keys, shapes, dtypes and values of the planned output against the reference, tensor by tensor."""
    planned = plan.by_name()
    ours = TensorSide(planned, lambda name, max_bytes: tensor_chunks(planned[name], source, max_bytes))
    theirs = TensorSide(reference.metas(), reference.iter_chunks)
    return compare_tensors(ours, theirs, Tolerance(atol, rtol), chunk_bytes=chunk_bytes,
                           dtype_hint="(use --dtype to compare after a cast)")


def check_against_reference(source_url: str, reference_url: str, options: MergeOptions = MergeOptions(), *,
                            atol: float = WEIGHT_TOLERANCE.atol, rtol: float = WEIGHT_TOLERANCE.rtol
                            ) -> ValidationReport:
    """Plan the merge of ``source_url`` and compare it with the Hugging Face folder ``reference_url``."""
    checkpoint = check_checkpoint(source_url, options.backend)
    config = read_config(options.hf_model_path or checkpoint.hf_dir)
    reference_ckpt = check_checkpoint(reference_url, "hf")
    source, reference = open_checkpoint(checkpoint), open_checkpoint(reference_ckpt)
    try:
        plan = plan_merge(checkpoint, source, config, options)
        checks = compare_plan_to_reference(plan, source, reference, atol=atol, rtol=rtol,
                                           chunk_bytes=options.chunk_bytes)
    finally:
        source.close()
        reference.close()
    return ValidationReport(source_url, tuple(checks), reference_url)
