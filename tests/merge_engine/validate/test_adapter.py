"""Adapter validation (`merge_engine.validate.adapter.validate_adapter`) is a real check in every dtype.

From one real LoRA checkpoint (verl FSDP2, 2 ranks) the engine writes, per output dtype (as
stored = float32, bfloat16, float16), the PEFT adapter release (adapter + clean base under base/)
and the fused model. Then:
- the right adapter PASSES in every dtype: in float32 the logits of PEFT(base + adapter) equal the
  fused model's; in bfloat16/float16 they differ only by rounding (the fused weight is rounded once,
  base and factors separately) and the check allows for exactly that;
- a MISSING adapter (every lora_B zero: PEFT adds nothing) FAILS in every dtype;
- a WRONG adapter (the update negated; or the update of another alpha) FAILS in every dtype.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from merge_engine.validate.adapter import validate_adapter
from tests.fixtures_pipeline import LORA_STEP, ROLE

DTYPES = [None, "bfloat16", "float16"]


@pytest.fixture(scope="module")
def releases(template_run, tmp_path_factory) -> dict:
    """dtype -> (adapter folder with base/, fused model folder), written by the engine."""
    from merge_engine.commands.extract import extract_lora
    from merge_engine.output.jobs import OutputOptions
    from merge_engine.commands.merge import merge_checkpoint
    from merge_engine.output.jobs import OutputOptions

    source = str(template_run.step_dir(LORA_STEP) / ROLE)
    root = tmp_path_factory.mktemp("adapter-validation")
    out = {}
    for dtype in DTYPES:
        adapter, fused = root / f"{dtype}-adapter", root / f"{dtype}-fused"
        extract_lora(source, str(adapter), OutputOptions(dtype=dtype))
        merge_checkpoint(source, str(fused), OutputOptions(dtype=dtype))
        out[dtype] = (adapter, fused)
    return out


def _altered(adapter: Path, tmp_path: Path, change) -> str:
    """A copy of the adapter release whose factors went through ``change(name, tensor)``."""
    copy = tmp_path / "altered"
    shutil.copytree(adapter, copy)
    weights = copy / "adapter_model.safetensors"
    tensors = load_file(str(weights))
    save_file({name: change(name, tensor).contiguous() for name, tensor in tensors.items()}, str(weights))
    return str(copy)


def _logit_check(report) -> dict:
    (check,) = [c for c in report.checks if c.name == "peft_logits"]
    return check


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_right_adapter_passes_in_every_dtype(releases, dtype):
    adapter, fused = releases[dtype]
    report = validate_adapter(str(adapter), fused_model_url=str(fused))
    assert report.ok, report.summary()
    check = _logit_check(report)
    assert check.ok and "of the base->fused change" in check.detail


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_missing_adapter_fails_in_every_dtype(releases, dtype, tmp_path):
    adapter, fused = releases[dtype]
    nothing = _altered(adapter, tmp_path, lambda name, t: torch.zeros_like(t) if "lora_B" in name else t)
    report = validate_adapter(nothing, fused_model_url=str(fused))
    assert not report.ok and not _logit_check(report).ok


@pytest.mark.parametrize("change", ["negated", "other alpha"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_wrong_adapter_fails_in_every_dtype(releases, dtype, change, tmp_path):
    adapter, fused = releases[dtype]
    factor = -1.0 if change == "negated" else 1.5  # the update of alpha * 1.5
    wrong = _altered(adapter, tmp_path, lambda name, t: (t.float() * factor).to(t.dtype) if "lora_B" in name else t)
    report = validate_adapter(wrong, fused_model_url=str(fused))
    assert not report.ok and not _logit_check(report).ok, _logit_check(report).detail
