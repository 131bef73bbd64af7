"""verl's ``test``: does a checkpoint, merged, equal a reference Hugging Face folder?

The checkpoint is prepared by `merge`'s own `MergeJob.prepare` (every check ``merge`` runs, so what
``merge`` refuses ``test`` refuses with the same named error), and the planned output's tensors are
streamed next to the reference's, chunk against chunk: nothing is written and neither model is held
in memory. The comparison is validation's one comparison (`merge_engine.validate.compare.compare_tensors`:
the same keys, shapes and dtypes, values within ``atol + rtol * |reference|``, default
`WEIGHT_TOLERANCE`); the report names the first failing key and the largest difference.
"""

from __future__ import annotations

from merge_engine.commands.merge import MergeJob
from merge_engine.output.jobs import OutputOptions
from merge_engine.formats.tensor_source import DEFAULT_CHUNK_BYTES, TensorSource
from merge_engine.layouts import open_hf_folder
from merge_engine.output.shard_job import tensor_chunks
from merge_engine.plan.merge_plan import MergePlan
from merge_engine.validate import Check, ValidationReport
from merge_engine.validate.compare import WEIGHT_TOLERANCE, TensorSide, Tolerance, compare_tensors


def compare_plan_to_reference(plan: MergePlan, source: TensorSource, reference: TensorSource, *,
                              atol: float, rtol: float, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> list[Check]:
    """Keys, shapes, dtypes and values of the planned output against the reference, tensor by tensor."""
    planned = plan.by_name()
    ours = TensorSide(planned, lambda name, max_bytes: tensor_chunks(planned[name], source, max_bytes))
    theirs = TensorSide(reference.metas(), reference.iter_chunks)
    return compare_tensors(ours, theirs, Tolerance(atol, rtol), chunk_bytes=chunk_bytes,
                           dtype_hint="(use --dtype to compare after a cast)")


def check_against_reference(source_url: str, reference_url: str, options: OutputOptions = OutputOptions(), *,
                            atol: float = WEIGHT_TOLERANCE.atol, rtol: float = WEIGHT_TOLERANCE.rtol
                            ) -> ValidationReport:
    """Prepare the merge of ``source_url`` as ``merge`` does and compare it with the Hugging Face folder
    ``reference_url``. Raises what ``merge``'s preparation raises."""
    prepared = MergeJob(source_url, "", options).prepare()  # no target: nothing is written
    try:
        (source,) = prepared.sources  # a merge plans one safetensors folder over one source
        reference = open_hf_folder(reference_url)
        try:
            plan = prepared.plan()
            assert plan is not None  # a merge plans one safetensors folder
            checks = compare_plan_to_reference(plan, source, reference, atol=atol, rtol=rtol,
                                               chunk_bytes=options.chunk_bytes)
        finally:
            reference.close()
    finally:
        prepared.close()
    return ValidationReport(source_url, tuple(checks), reference_url)
