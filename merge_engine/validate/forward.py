"""The one forward pass: load a Hugging Face folder with transformers and run fixed tokens through it.

`load_model` picks the class from the config's architecture (its ``*For...`` suffix: causal LM,
token / sequence classification, image-text-to-text, masked LM; else ``AutoModel``); `logits_of`
runs `fixed_token_ids` (the same ids for every model compared) and returns float32 logits on the
CPU. `forward_check` uses them for a merged model (finite logits; with a reference, the logits
compared within `LOGIT_TOLERANCE`), `merge_engine.validate.adapter` for PEFT(base + adapter) and
the fused model. The device is `checked_device` (cuda when this torch sees one; a device that cannot be
used is `InvalidDevice` before anything loads). One model is on the device at a time; each is freed
(`release_model`: its device memory handed back) before the next loads; logits are compared on the CPU.
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Iterator
from typing import Any

from merge_engine.devices import resolve_device
from merge_engine.validate.compare import LOGIT_TOLERANCE
from merge_engine.validate.report import Check, ValidationReport
from merge_engine.validate.staging import local_folder

FORWARD_SEQ_LEN = 16


def default_device() -> str:
    """cuda when this torch sees a CUDA device, else cpu."""
    return str(resolve_device(None))


def checked_device(device: str | None) -> str:
    """``device`` checked (`merge_engine.devices.resolve_device`; None or ``auto``: `default_device`)."""
    return str(resolve_device(device))


def release_model(model: Any) -> None:
    """Hand back the device memory of ``model`` now, even while a caller still holds the module: a model
    on a GPU is moved to the ``meta`` device (no storage), then the allocator's cache is emptied."""
    import torch

    on_gpu = any(p.device.type == "cuda" for p in model.parameters())
    if on_gpu:
        with contextlib.suppress(Exception):  # a module that refuses the move is freed by reference count
            model.to("meta")
    gc.collect()
    if on_gpu:
        torch.cuda.empty_cache()


def fixed_token_ids(vocab_size: int, length: int = FORWARD_SEQ_LEN) -> list[int]:
    """Deterministic token ids spread over the vocabulary (the same for model and reference)."""
    return [(7919 * i + 13) % vocab_size for i in range(length)]


def architecture_of(config: Any) -> str:
    archs = getattr(config, "architectures", None) or []
    return archs[0] if archs else ""


def auto_class(architecture: str) -> Any:
    """The ``AutoModelFor*`` class for an architecture name (by its suffix)."""
    import transformers

    for suffix, auto in (
        ("ForCausalLM", "AutoModelForCausalLM"),
        ("LMHeadModel", "AutoModelForCausalLM"),  # GPT-2's GPT2LMHeadModel
        ("ForTokenClassification", "AutoModelForTokenClassification"),
        ("ForSequenceClassification", "AutoModelForSequenceClassification"),
        ("ForConditionalGeneration", "AutoModelForImageTextToText"),
        ("ForMaskedLM", "AutoModelForMaskedLM"),
    ):
        if architecture.endswith(suffix):
            return getattr(transformers, auto)
    return transformers.AutoModel


def model_class(config: Any) -> tuple[Any, bool]:
    """(class, via_auto): the config's own architecture class when transformers has it, else Auto."""
    import transformers

    cls = getattr(transformers, architecture_of(config), None)
    if cls is not None and isinstance(cls, type) and hasattr(cls, "_from_config"):
        return cls, False
    return auto_class(architecture_of(config)), True


@contextlib.contextmanager
def loaded_model(local_path: str, device: str, *, dtype: Any = "auto",
                 trust_remote_code: bool = False) -> Iterator[tuple[Any, Any]]:
    """(model in eval mode on ``device``, its config); the model is freed on exit (`release_model`).

    ``dtype``: "auto" (as stored) or a torch dtype to compute in."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(local_path, trust_remote_code=trust_remote_code)
    model = auto_class(architecture_of(config)).from_pretrained(
        local_path, dtype=dtype, trust_remote_code=trust_remote_code)
    try:
        model.to(device).eval()
        yield model, config
    finally:
        release_model(model)
        del model


def logits_of(model: Any, config: Any, device: str) -> Any:
    """The forward pass: logits for `fixed_token_ids`, as float32 on the CPU."""
    import torch

    vocab = getattr(config, "vocab_size", None) or config.get_text_config().vocab_size
    ids = torch.tensor([fixed_token_ids(vocab)], device=device)
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits.float().cpu()


def model_logits(local_path: str, device: str, *, dtype: Any = "auto",
                 trust_remote_code: bool = False) -> tuple[Any, str]:
    """(logits of the folder's model, what was loaded: class, dtype, device)."""
    with loaded_model(local_path, device, dtype=dtype, trust_remote_code=trust_remote_code) as (model, config):
        loaded = f"{type(model).__name__} ({next(model.parameters()).dtype}) on {device}"
        return logits_of(model, config, device), loaded


def forward_check(model_url: str, reference_url: str | None = None, device: str | None = None, *,
                  atol: float = LOGIT_TOLERANCE.atol, rtol: float = LOGIT_TOLERANCE.rtol,
                  trust_remote_code: bool = False) -> ValidationReport:
    """``from_pretrained`` + a forward pass on fixed token ids: finite logits; with a reference,
    ``allclose(logits, reference_logits, atol, rtol)`` and the max abs diff. Remote folders are staged.
    One model is in memory at a time."""
    import torch

    device = checked_device(device)
    checks: list[Check] = []
    with local_folder(model_url) as path:
        started = time.perf_counter()
        try:
            logits, loaded = model_logits(path, device, trust_remote_code=trust_remote_code)
        except Exception as exc:  # noqa: BLE001 - a model that does not load is a failed check
            return ValidationReport(model_url, (Check("load", False, f"{type(exc).__name__}: {exc}"),), reference_url)
        checks.append(Check("load", True, f"{loaded} in {time.perf_counter() - started:.1f}s"))
        finite = bool(torch.isfinite(logits).all())
        checks.append(Check("forward", finite, f"logits {list(logits.shape)}" + ("" if finite else " contain NaN/inf")))
    if reference_url is not None:
        with local_folder(reference_url) as ref_path:
            try:
                ref_logits, _ = model_logits(ref_path, device, trust_remote_code=trust_remote_code)
            except Exception as exc:  # noqa: BLE001
                checks.append(Check("reference_logits", False, f"reference does not load: {exc}"))
                return ValidationReport(model_url, tuple(checks), reference_url)
        if ref_logits.shape != logits.shape:
            checks.append(Check("reference_logits", False, f"shape {list(logits.shape)} vs {list(ref_logits.shape)}"))
        else:
            max_diff = float((logits - ref_logits).abs().max())
            close = bool(torch.allclose(logits, ref_logits, atol=atol, rtol=rtol))
            checks.append(Check("reference_logits", close, f"max |diff| {max_diff:.3g} (atol={atol}, rtol={rtol})"))
    return ValidationReport(model_url, tuple(checks), reference_url)
