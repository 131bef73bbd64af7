"""The one comparison of tensors against a reference, and its tolerances.

Semantics (verl's ``test``): the same keys, the same shapes, the same dtypes, and every value within
``|ours - reference| <= atol + rtol * |reference|`` (integers and booleans: equal; NaN is never
within tolerance, not even against NaN). Tensors are compared in sorted key order, chunk against
chunk (streams of any chunking are re-cut to match), and the comparison stops at the first tensor
with a value outside tolerance, naming it, the element and both values.

Tolerances, one set for the engine (the CLI's ``--atol`` / ``--rtol`` and the pipeline default):
- weights: `WEIGHT_TOLERANCE` = atol 1e-6, rtol 1e-6 (verl's test). A merge is exact: these only
  absorb nothing but float noise in hand-made references;
- logits (`merge_engine.validate.forward`): `LOGIT_TOLERANCE` = atol 1e-4, rtol 1e-4 (two forward
  passes over equal weights may sum in different orders).

Used by `compare_to_reference` (two HF folders), `merge_engine.commands.reference_check` (a checkpoint, as
planned, against an HF folder) and `validate_model`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from merge_engine.formats.chunks import aligned_chunks
from merge_engine.errors import CorruptShard
from merge_engine.formats.safetensors_file import CODES
from merge_engine.validate.report import Check, ValidationReport
from merge_engine.validate.weights import CHUNK_BYTES, FolderWeights, few, scan_weights, top_level_listing


@dataclass(frozen=True)
class Tolerance:
    """``|ours - reference| <= atol + rtol * |reference|``."""

    atol: float
    rtol: float


WEIGHT_TOLERANCE = Tolerance(atol=1e-6, rtol=1e-6)  # verl's test
LOGIT_TOLERANCE = Tolerance(atol=1e-4, rtol=1e-4)


@dataclass(frozen=True)
class TensorSide:
    """One side of a comparison: name -> (shape, dtype) records, and the flat chunks of one tensor."""

    metas: Mapping[str, Any]  # anything with .shape and .dtype (TensorMeta, PlannedTensor)
    chunks: Callable[[str, int], Iterator[Any]]


def _dtype_name(dtype: Any) -> str:
    return CODES.get(dtype, str(dtype))


def _compare_values(ours: Iterator[Any], theirs: Iterator[Any], floating: bool,
                    tolerance: Tolerance) -> tuple[float, str | None]:
    """(max finite |ours - reference|, None) or (max so far, why the tensor fails)."""
    import torch

    atol, rtol = tolerance.atol, tolerance.rtol
    max_diff = 0.0
    done = 0
    for m_chunk, r_chunk in aligned_chunks(ours, theirs, error=lambda why: CorruptShard(why)):
        if floating:
            a, b = m_chunk.double(), r_chunk.double()
            diff = (a - b).abs()
            close = (a == b) | (diff <= atol + rtol * b.abs())
            finite_diff = diff[torch.isfinite(diff)]
            if finite_diff.numel():
                max_diff = max(max_diff, float(finite_diff.max()))
        else:
            close = m_chunk == r_chunk
        if not bool(close.all()):
            bad = int((~close).nonzero()[0].item())
            count = int((~close).sum())
            return max_diff, (f"element {done + bad}: {m_chunk[bad].item()!r} vs reference {r_chunk[bad].item()!r}"
                              f" ({count} elements of this chunk outside atol={atol}, rtol={rtol})")
        done += m_chunk.numel()
    return max_diff, None


def compare_tensors(ours: TensorSide, reference: TensorSide, tolerance: Tolerance = WEIGHT_TOLERANCE, *,
                    chunk_bytes: int = CHUNK_BYTES, dtype_hint: str = "") -> list[Check]:
    """``reference_keys``, ``reference_shapes``, ``reference_dtypes``, ``reference_values`` (see the
    module docstring). ``dtype_hint`` is appended to a failed dtype check (what the user can do)."""
    mine, theirs = set(ours.metas), set(reference.metas)
    missing, extra = sorted(theirs - mine), sorted(mine - theirs)
    detail = "; ".join(filter(None, [f"missing {few(missing)}" if missing else "",
                                     f"unexpected {few(extra)}" if extra else ""]))
    checks = [Check("reference_keys", not detail, detail or f"{len(theirs)} keys")]
    common = sorted(mine & theirs)
    shape = {k: (tuple(ours.metas[k].shape), tuple(reference.metas[k].shape)) for k in common}
    shape_bad = [k for k in common if shape[k][0] != shape[k][1]]
    checks.append(Check("reference_shapes", not shape_bad, "; ".join(
        f"{k}: {list(shape[k][0])} vs {list(shape[k][1])}" for k in shape_bad[:5])))
    dtype_bad = [k for k in common if k not in shape_bad and ours.metas[k].dtype != reference.metas[k].dtype]
    checks.append(Check("reference_dtypes", not dtype_bad, "; ".join(
        f"{k}: {_dtype_name(ours.metas[k].dtype)} vs {_dtype_name(reference.metas[k].dtype)}"
        for k in dtype_bad[:5]) + (f" {dtype_hint}" if dtype_bad and dtype_hint else "")))

    comparable = [k for k in common if k not in shape_bad and k not in dtype_bad]
    max_diff, worst, failure = 0.0, "", None
    for key in comparable:
        floating = ours.metas[key].dtype.is_floating_point
        diff, why = _compare_values(ours.chunks(key, chunk_bytes), reference.chunks(key, chunk_bytes), floating,
                                    tolerance)
        if diff >= max_diff:
            max_diff, worst = diff, key
        if why:
            failure = f"first mismatch in {key}: {why}"
            break
    if failure:
        checks.append(Check("reference_values", False, failure))
    else:
        checks.append(Check("reference_values", True,
                            f"{len(comparable)} tensors within atol={tolerance.atol}, rtol={tolerance.rtol}; "
                            f"max |diff| {max_diff:.3g}" + (f" ({worst})" if worst and max_diff else "")))
    return checks


def side_of(weights: FolderWeights) -> TensorSide:
    """A folder's weights as one side of a comparison."""
    return TensorSide(weights.source.metas(), weights.source.iter_chunks)


def _weights_or_failure(url: str, label: str) -> tuple[FolderWeights | None, list[Check]]:
    checks, weights = scan_weights(url, top_level_listing(url))
    if weights is None:
        failed = next(c for c in checks if not c.ok)
        return None, [Check(f"{label}_weights", False, f"{failed.name}: {failed.detail}")]
    return weights, []


def compare_to_reference(model_url: str, reference_url: str, atol: float = WEIGHT_TOLERANCE.atol,
                         rtol: float = WEIGHT_TOLERANCE.rtol, *, chunk_bytes: int = CHUNK_BYTES) -> ValidationReport:
    """The model folder's weights against the reference folder's (see the module docstring)."""
    model, checks = _weights_or_failure(model_url, "model")
    ref, ref_checks = _weights_or_failure(reference_url, "reference")
    checks += ref_checks
    try:
        if model is not None and ref is not None:
            checks += compare_tensors(side_of(model), side_of(ref), Tolerance(atol, rtol), chunk_bytes=chunk_bytes)
    finally:
        for opened in (model, ref):
            if opened is not None:
                opened.close()
    return ValidationReport(model_url, tuple(checks), reference_url)
