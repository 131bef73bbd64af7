"""Validation of a PEFT adapter folder -> a `ValidationReport` (what the publish step stores).

Checks, each a named `Check`:
- ``adapter_config``: ``adapter_config.json`` + ``adapter_model.safetensors`` read by the engine
  (`merge_engine.lora.adapter_io.read_adapter`: plain LoRA, alpha known, factors consistent);
- ``adapter_finite``: no NaN/inf in any adapter tensor (read in chunks);
- with a ``base/`` folder (``include_base``): the base's structure (``base:<check>``, the same
  checks as a merged model) and ``adapter_fits_base`` (every target module exists with its shape);
- with ``forward``: ``peft_load`` (``PeftModel.from_pretrained(base, adapter)``, finite logits on
  fixed tokens) and, given the fused model, ``peft_logits``: those logits equal the fused model's
  within ``atol + rtol * |fused|``.
A failed check is a result (the report says which); nothing here raises for bad content.
"""

from __future__ import annotations

import contextlib
import gc
import tempfile
from collections.abc import Iterator
from typing import Any, Optional

from merge_engine import storage
from merge_engine.errors import StepmergeError
from merge_engine.validate import (
    Check,
    ValidationReport,
    default_device,
    fixed_token_ids,
    validate_structure,
)

BASE_DIR = "base"


@contextlib.contextmanager
def local_folder(url: str) -> Iterator[str]:
    """A local path with the folder's files; a remote folder is staged into a temp dir."""
    if storage.is_local(url):
        yield storage.local_path(url)
        return
    with tempfile.TemporaryDirectory(prefix="stepmerge-adapter-check-") as tmp:
        storage.stage_in(url, storage.list_files(url), tmp)
        yield tmp


def _model_logits(path: str, device: str, adapter_path: Optional[str] = None) -> Any:
    import torch
    import transformers

    config = transformers.AutoConfig.from_pretrained(path)
    architecture = (getattr(config, "architectures", None) or ["AutoModelForCausalLM"])[0]
    model_class = getattr(transformers, architecture, transformers.AutoModelForCausalLM)
    model = model_class.from_pretrained(path, dtype=torch.float32)
    try:
        if adapter_path is not None:
            from peft import PeftModel

            model = PeftModel.from_pretrained(model, adapter_path)
        model.to(device).eval()
        ids = torch.tensor([fixed_token_ids(config.vocab_size)], device=device)
        with torch.no_grad():
            return model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits.float().cpu()
    finally:
        del model
        gc.collect()


def _finite(source: Any) -> Check:
    import torch

    bad = [name for name in source.metas()
           if any(not bool(torch.isfinite(chunk.float()).all()) for chunk in source.iter_chunks(name))]
    return Check("adapter_finite", not bad, f"NaN/inf in {bad[:3]}" if bad else f"{len(source.metas())} tensors")


def validate_adapter(adapter_url: str, *, fused_model_url: Optional[str] = None, forward: bool = True,
                  device: Optional[str] = None, atol: float = 1e-4, rtol: float = 1e-4) -> ValidationReport:
    """Validate the adapter folder at ``adapter_url`` (see the module docstring)."""
    from merge_engine.layouts import check_checkpoint, open_checkpoint
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
    finally:
        source.close()

    base_url = storage.join(adapter_url, BASE_DIR)
    has_base = bool(storage.list_files(base_url))
    if has_base:
        base_report = validate_structure(base_url)
        checks += [Check(f"base:{c.name}", c.ok, c.detail) for c in base_report.checks]
        base = open_checkpoint(check_checkpoint(base_url, "hf"))
        try:
            check_fits_base(adapter, base.metas(), base_url)
            checks.append(Check("adapter_fits_base", True, "every target module exists with its shape"))
        except StepmergeError as exc:
            checks.append(Check("adapter_fits_base", False, str(exc)))
        finally:
            base.close()
    else:
        checks.append(Check("adapter_fits_base", True, "no base/ in this release: not checked"))

    if forward and has_base and all(c.ok for c in checks):
        import torch

        device = device or default_device()
        with local_folder(adapter_url) as adapter_path:
            try:
                peft_logits = _model_logits(f"{adapter_path}/{BASE_DIR}", device, adapter_path)
            except Exception as exc:  # noqa: BLE001 - an adapter PEFT cannot load is a failed check
                checks.append(Check("peft_load", False, f"{type(exc).__name__}: {exc}"))
                return ValidationReport(adapter_url, tuple(checks), fused_model_url)
        finite = bool(torch.isfinite(peft_logits).all())
        checks.append(Check("peft_load", finite, f"PeftModel on {device}: logits {list(peft_logits.shape)}"
                                                 + ("" if finite else " contain NaN/inf")))
        if fused_model_url is not None:
            with local_folder(fused_model_url) as fused_path:
                fused = _model_logits(fused_path, device)
            diff = float((peft_logits - fused).abs().max())
            close = bool(torch.allclose(peft_logits, fused, atol=atol, rtol=rtol))
            checks.append(Check("peft_logits", close, f"max |PEFT(base+adapter) - fused| = {diff:.3g} "
                                                      f"(atol={atol}, rtol={rtol})"))
    return ValidationReport(adapter_url, tuple(checks), fused_model_url)
