"""`validate_model`: every check of a merged model folder in one report (what the pipeline runs)."""

from __future__ import annotations

import contextlib

from merge_engine import storage
from merge_engine.validate.compare import LOGIT_TOLERANCE, WEIGHT_TOLERANCE, compare_to_reference
from merge_engine.validate.forward import checked_device, forward_check
from merge_engine.validate.report import ValidationReport
from merge_engine.validate.staging import local_folder
from merge_engine.validate.structure import validate_structure
from merge_engine.validate.weights import CHUNK_BYTES


def validate_model(model_url: str, reference_url: str | None = None, *, forward: bool = True,
                   atol: float = WEIGHT_TOLERANCE.atol, rtol: float = WEIGHT_TOLERANCE.rtol,
                   logits_atol: float = LOGIT_TOLERANCE.atol, logits_rtol: float = LOGIT_TOLERANCE.rtol,
                   device: str | None = None, trust_remote_code: bool = False,
                   chunk_bytes: int = CHUNK_BYTES, weights_format: str | None = None) -> ValidationReport:
    """Structure, then (with a reference) values, then (with `forward`) load + forward + logits.

    ``weights_format``: the names the structure check expects (None: as ``stepmerge.json`` records).

    A remote folder is staged once into a temp dir when a forward pass needs it, and every check
    then reads the staged copy; the report names the original URLs.
    """
    if forward:
        device = checked_device(device)  # a device this machine cannot use fails before anything is read
    with contextlib.ExitStack() as stack:
        model_path, reference_path = model_url, reference_url
        if forward and not storage.is_local(model_url):
            model_path = stack.enter_context(local_folder(model_url))
        if forward and reference_url is not None and not storage.is_local(reference_url):
            reference_path = stack.enter_context(local_folder(reference_url))
        report = validate_structure(model_path, trust_remote_code=trust_remote_code, chunk_bytes=chunk_bytes,
                                    weights_format=weights_format)
        if reference_path is not None:
            report = report.extended(compare_to_reference(model_path, reference_path, atol, rtol,
                                                          chunk_bytes=chunk_bytes))
        if forward:
            report = report.extended(forward_check(model_path, reference_path, device, atol=logits_atol,
                                                   rtol=logits_rtol, trust_remote_code=trust_remote_code))
    return ValidationReport(model_url, report.checks, reference_url)
