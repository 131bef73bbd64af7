"""verl's ``test``: does a checkpoint, merged, equal a reference Hugging Face folder?

The checkpoint is planned exactly as `merge` would plan it and its tensors are streamed next to
the reference's, chunk against chunk: nothing is written and neither model is held in memory.
Same semantics as verl's test: the same keys, shapes and dtypes, and values within
``atol + rtol * |reference|``. The report names the first failing key and the largest difference.
"""

from __future__ import annotations

import torch

from merge_engine.chunks import aligned_chunks
from merge_engine.hf_metadata import read_config
from merge_engine.layouts import check_checkpoint, open_checkpoint
from merge_engine.merge import MergeOptions, plan_merge
from merge_engine.merge_plan import MergePlan
from merge_engine.tensor_source import DEFAULT_CHUNK_BYTES, TensorSource
from merge_engine.validate import Check, ValidationReport
from merge_engine.writer import tensor_chunks


def compare_plan_to_reference(plan: MergePlan, source: TensorSource, reference: TensorSource, *,
                              atol: float, rtol: float, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> list[Check]:
    """Keys, shapes, dtypes and values of the planned output against the reference, tensor by tensor."""
    ref_metas = reference.metas()
    planned = plan.by_name()
    missing = sorted(set(ref_metas) - set(planned))
    extra = sorted(set(planned) - set(ref_metas))
    checks = [Check("same keys", not missing and not extra,
                    f"missing {missing[:5]}, extra {extra[:5]}" if missing or extra else f"{len(planned)} tensors")]
    shape_bad = [n for n in planned if n in ref_metas and planned[n].shape != ref_metas[n].shape]
    checks.append(Check("same shapes", not shape_bad, "" if not shape_bad else
                        f"{shape_bad[0]}: {planned[shape_bad[0]].shape} vs {ref_metas[shape_bad[0]].shape}"))
    dtype_bad = [n for n in planned if n in ref_metas and planned[n].dtype != ref_metas[n].dtype]
    checks.append(Check("same dtypes", not dtype_bad, "" if not dtype_bad else
                        f"{dtype_bad[0]}: {planned[dtype_bad[0]].dtype} vs {ref_metas[dtype_bad[0]].dtype} "
                        "(use --dtype to compare after a cast)"))
    first_bad, worst, worst_name = None, 0.0, ""
    for name, tensor in planned.items():
        if name not in ref_metas or tensor.shape != ref_metas[name].shape:
            continue
        pairs = aligned_chunks(tensor_chunks(tensor, source, chunk_bytes), reference.iter_chunks(name, chunk_bytes))
        for ours, theirs in pairs:
            ours, theirs = ours.to(torch.float64), theirs.to(torch.float64)
            diff = (ours - theirs).abs()
            close = (ours == theirs) | (diff <= atol + rtol * theirs.abs())  # NaN is never close
            bad = ~close
            if diff.numel():
                top = float(diff.nan_to_num(nan=float("inf")).max())
                if top > worst:
                    worst, worst_name = top, name
            if bool(bad.any()) and first_bad is None:
                first_bad = name
    checks.append(Check("values within tolerance", first_bad is None,
                        (f"first mismatch in {first_bad}; " if first_bad else "")
                        + f"max |diff| {worst:.3g}{' in ' + worst_name if worst_name else ''} "
                          f"(atol {atol:g}, rtol {rtol:g})"))
    return checks


def check_against_reference(source_url: str, reference_url: str, options: MergeOptions = MergeOptions(), *,
                            atol: float = 1e-6, rtol: float = 1e-6) -> ValidationReport:
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
