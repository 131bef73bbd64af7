"""Validation of a PEFT adapter folder -> a `ValidationReport` (what the publish step stores).

Loads and forward passes are `merge_engine.validate.forward`'s (the one forward pass), in float32.

Checks, each a named `Check`:
- ``adapter_config``: ``adapter_config.json`` + ``adapter_model.safetensors`` read by the engine
  (`merge_engine.lora.adapter_io.read_adapter`: plain LoRA, alpha known, factors consistent);
- ``adapter_finite``: no NaN/inf in any adapter tensor (read in chunks);
- with a ``base/`` folder (``include_base``): the base's structure (``base:<check>``, the same
  checks as a merged model) and ``adapter_fits_base`` (every target module exists with its shape);
- with ``forward``: ``peft_load`` (``base.load_adapter(adapter)``, PEFT through transformers, finite logits on
  fixed tokens) and, given the fused model, ``peft_logits``: PEFT(base + adapter) reproduces the
  fused model (see `compare_logits`).
A failed check is a result (the report says which); nothing here raises for bad content.

How ``peft_logits`` judges (dtype-aware, and still a real check). Three logits on the same tokens:
``base`` (the adapter disabled), ``peft`` (enabled) and ``fused``; ``error = peft - fused`` and
``change = fused - base`` (what the adapter does to the model). In float32 the two paths agree to
float noise: ``|error| <= atol + rtol * |fused|`` everywhere passes. A bfloat16/float16 release
rounds differently on the two paths (the fused weight is rounded once, base and factors each on
their own), so the logits differ by rounding, however right the adapter. Then it passes when
- ``rms(error) <= noise``, with ``noise = NOISE_FACTOR * eps * rms(fused)`` and ``eps`` the machine
  epsilon of the coarsest dtype among base, adapter and fused weights (what rounding can explain);
- and, when the adapter's change stands out of that noise (``rms(change) > noise``), the adapter
  reproduces at least ``1 - MAX_UNEXPLAINED`` of it: ``rms(error) <= MAX_UNEXPLAINED * rms(change)``.
A missing adapter (PEFT adds nothing) leaves ``error = -change``; a wrong one (another update,
another alpha) leaves the difference of the two updates: both fail unless the adapter's whole
effect on the logits is within rounding noise, where no comparison of logits could tell them
apart (the detail says so).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Optional

from merge_engine import storage
from merge_engine.errors import StepmergeError
from merge_engine.lora.keys import BASE_DIR
from merge_engine.validate.compare import LOGIT_TOLERANCE
from merge_engine.validate.forward import checked_device, loaded_model, logits_of, model_logits
from merge_engine.validate.report import Check, ValidationReport
from merge_engine.validate.staging import local_folder
from merge_engine.validate.structure import recorded_weights_format, validate_structure
from merge_engine.validate.weights import top_level_listing

NOISE_FACTOR = 4.0  # rounding noise allowed, in units of eps * rms(fused logits) (measured: ~0.4 on tiny models)
MAX_UNEXPLAINED = 0.5  # the adapter must reproduce at least half of the base -> fused change


def _peft_logits(base_path: str, adapter_path: str, device: str) -> tuple[Any, Any]:
    """(logits with the adapter, logits of the same model without it), in float32.

    The adapter is loaded as transformers loads one onto a model (``model.load_adapter``: PEFT, with
    the model's own checkpoint-name mapping). PEFT 0.21's ``PeftModel.from_pretrained`` maps only MoE
    names for transformers v5, so a Hub-named vision-language adapter (``model.layers...``) would load
    as nothing there; on every other adapter both give the same logits."""
    import torch

    with loaded_model(base_path, device, dtype=torch.float32) as (model, config):
        without = logits_of(model, config, device)
        model.load_adapter(adapter_path)
        model.to(device).eval()
        return logits_of(model, config, device), without


def _finite(source: Any) -> Check:
    import torch

    bad = [name for name in source.metas()
           if any(not bool(torch.isfinite(chunk.float()).all()) for chunk in source.iter_chunks(name))]
    return Check("adapter_finite", not bad, f"NaN/inf in {bad[:3]}" if bad else f"{len(source.metas())} tensors")


def coarsest_dtype(dtypes: Iterable[Any]) -> Any:
    """The floating dtype with the largest machine epsilon among ``dtypes`` (float32 when none is floating)."""
    import torch

    floating = [d for d in dtypes if isinstance(d, torch.dtype) and d.is_floating_point]
    return max(floating, key=lambda d: torch.finfo(d).eps, default=torch.float32)


def _folder_dtypes(url: str) -> set[Any]:
    from merge_engine.layouts import open_hf_folder

    source = open_hf_folder(url)
    try:
        return {meta.dtype for meta in source.metas().values()}
    finally:
        source.close()


@dataclass(frozen=True)
class LogitComparison:
    """How PEFT(base + adapter) compares with the fused model (see the module docstring)."""

    ok: bool
    detail: str


def compare_logits(peft: Any, fused: Any, base: Any, dtype: Any, *, atol: float = LOGIT_TOLERANCE.atol,
                   rtol: float = LOGIT_TOLERANCE.rtol,
                   noise_factor: float = NOISE_FACTOR, max_unexplained: float = MAX_UNEXPLAINED,
                   ours: str = "PEFT(base+adapter)", reference: str = "fused") -> LogitComparison:
    """Judge ``peft`` against ``fused`` (``base``: the logits without the adapter; ``dtype``: the
    coarsest dtype the weights were stored in; ``ours`` / ``reference``: what the detail calls the two)."""
    import torch

    error, change = peft - fused, fused - base
    rms = lambda t: float(t.pow(2).mean().sqrt())  # noqa: E731
    max_error, rms_error, rms_change = float(error.abs().max()), rms(error), rms(change)
    explained = 1.0 - rms_error / rms_change if rms_change > 0 else (1.0 if rms_error == 0 else 0.0)
    numbers = (f"max |{ours} - {reference}| = {max_error:.3g}, rms {rms_error:.3g}; {ours} reproduces "
               f"{100 * explained:.1f}% of the base->{reference} change (rms {rms_change:.3g})")
    if bool(torch.allclose(peft, fused, atol=atol, rtol=rtol)):
        return LogitComparison(True, f"{numbers}; equal within atol={atol:g}, rtol={rtol:g}")
    eps = torch.finfo(dtype).eps
    noise = noise_factor * eps * rms(fused)
    rule = f"{str(dtype).removeprefix('torch.')} rounding allows rms {noise:.3g} ({noise_factor:g} eps x rms({reference}))"
    if rms_error > noise:
        return LogitComparison(False, f"{numbers}; more than rounding: {rule}")
    if rms_change <= noise:
        return LogitComparison(True, f"{numbers}; within rounding ({rule}), but the adapter's whole change is "
                                     "itself within rounding noise: the logits cannot tell this adapter from none")
    if rms_error > max_unexplained * rms_change:
        return LogitComparison(False, f"{numbers}; less than {100 * (1 - max_unexplained):.0f}% reproduced")
    return LogitComparison(True, f"{numbers}; within rounding ({rule})")


def validate_adapter(adapter_url: str, *, fused_model_url: Optional[str] = None, forward: bool = True,
                     device: Optional[str] = None, atol: float = LOGIT_TOLERANCE.atol,
                     rtol: float = LOGIT_TOLERANCE.rtol) -> ValidationReport:
    """Validate the adapter folder at ``adapter_url`` (see the module docstring)."""
    from merge_engine.layouts import open_hf_folder
    from merge_engine.lora.adapter_io import check_fits_base, read_adapter

    checks: list[Check] = []
    try:
        adapter, source = read_adapter(adapter_url)
    except StepmergeError as exc:
        return ValidationReport(adapter_url, (Check("adapter_config", False, str(exc)),))
    try:
        ranks = sorted({m.rank for m in adapter.modules.values()})
        checks.append(Check("adapter_config", True, f"{len(adapter.modules)} LoRA modules, ranks {ranks}, "
                                                    f"lora_alpha={adapter.settings.lora_alpha:g}"))
        checks.append(_finite(source))
        dtypes = {meta.dtype for meta in source.metas().values()}
    finally:
        source.close()

    base_url = storage.join(adapter_url, BASE_DIR)
    has_base = bool(storage.list_files(base_url))
    if has_base:
        # base/ is named as the adapter's extraction recorded (its stepmerge.json is the adapter folder's)
        base_report = validate_structure(base_url, weights_format=recorded_weights_format(
            adapter_url, top_level_listing(adapter_url)))
        checks += [Check(f"base:{c.name}", c.ok, c.detail) for c in base_report.checks]
        base = open_hf_folder(base_url)
        try:
            check_fits_base(adapter, base.metas(), base_url)
            checks.append(Check("adapter_fits_base", True, "every target module exists with its shape"))
            dtypes |= {meta.dtype for meta in base.metas().values()}
        except StepmergeError as exc:
            checks.append(Check("adapter_fits_base", False, str(exc)))
        finally:
            base.close()
    else:
        checks.append(Check("adapter_fits_base", True, "no base/ in this release: not checked"))

    if forward and has_base and all(c.ok for c in checks):
        import torch

        device = checked_device(device)
        with local_folder(adapter_url) as adapter_path:
            try:
                peft_logits, base_logits = _peft_logits(f"{adapter_path}/{BASE_DIR}", adapter_path, device)
            except Exception as exc:  # noqa: BLE001 - an adapter PEFT cannot load is a failed check
                checks.append(Check("peft_load", False, f"{type(exc).__name__}: {exc}"))
                return ValidationReport(adapter_url, tuple(checks), fused_model_url)
        finite = bool(torch.isfinite(peft_logits).all())
        checks.append(Check("peft_load", finite, f"adapter loaded on {device}: logits {list(peft_logits.shape)}"
                                                 + ("" if finite else " contain NaN/inf")))
        if fused_model_url is not None:
            with local_folder(fused_model_url) as fused_path:
                fused, _ = model_logits(fused_path, device, dtype=torch.float32)
            dtype = coarsest_dtype(dtypes | _folder_dtypes(fused_model_url))
            verdict = compare_logits(peft_logits, fused, base_logits, dtype, atol=atol, rtol=rtol)
            checks.append(Check("peft_logits", verdict.ok, verdict.detail))
    return ValidationReport(adapter_url, tuple(checks), fused_model_url)
