"""The SVD commands on each device: ``extract-lora --finetuned F --device D`` and ``merge-lora --output adapter
--rank r --device D``.

Each variant asserts the same truth, known outside stepmerge, on its device: the CPU variant always runs;
the CUDA variant runs where this torch sees a CUDA device and is skipped elsewhere with the reason
'no CUDA device' (never silently passed). The truth:
- extraction from PEFT's ``merge_and_unload`` of a known adapter at a rank above every update's: each module
  keeps its true rank, errors ~0, and PEFT loading the extracted adapter gives the fine-tune's logits; the
  provenance records the device the SVD ran on;
- re-factoring a weighted sum of two adapters at rank 3: the product B @ A of each module is PEFT's own
  ``add_weighted_adapter(..., combination_type="svd")``'s, and the reported error is the true one.
"""

from __future__ import annotations

import json

import pytest
import torch

from merge_engine.commands.extract import extract_lora_svd
from merge_engine.output.jobs import OutputOptions
from tests.merge_engine.lora.conftest import load_causal_lm, logits, peft_logits
from tests.merge_engine.lora.test_combine import svd_refactoring_and_peft_svd
from tests.merge_engine.lora.test_fuse import ATOL, RTOL

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA)]


@pytest.fixture(scope="module")
def finetune(tmp_path_factory, tiny_base, peft_adapters) -> str:
    from peft import PeftModel

    folder = tmp_path_factory.mktemp("finetune") / "model"
    PeftModel.from_pretrained(load_causal_lm(tiny_base), peft_adapters["patterns"]).merge_and_unload() \
        .save_pretrained(str(folder))
    return str(folder)


@pytest.mark.parametrize("device", DEVICES)
def test_svd_extraction_on_the_device_recovers_the_finetune(device, tmp_path, tiny_base, finetune):
    result = extract_lora_svd(tiny_base, finetune, str(tmp_path / "ad"), OutputOptions(rank=8, device=device))
    assert max(r.relative_error for r in result.modules) < 1e-5
    ranks = {r.module: r.rank for r in result.modules}
    assert ranks["model.layers.1.self_attn.q_proj"] == 2 and ranks["model.layers.0.mlp.gate_proj"] == 3
    assert ranks["model.layers.0.self_attn.k_proj"] == 4
    provenance = json.load(open(tmp_path / "ad" / "stepmerge.json"))
    assert provenance["device"].split(":")[0] == device
    # on cuda the factors carry cuSOLVER's float32 rounding (each module's error stays < 1e-5, as asserted
    # above): the logits then differ from the fine-tune's by up to ~7e-5 (seen on an H200), not 5e-5
    atol = ATOL if device == "cpu" else 4 * ATOL
    torch.testing.assert_close(peft_logits(tiny_base, str(tmp_path / "ad")), logits(load_causal_lm(finetune)),
                               atol=atol, rtol=RTOL)


@pytest.mark.parametrize("device", DEVICES)
def test_svd_refactoring_on_the_device_is_peft_svd(device, tmp_path, tiny_base, peft_adapters):
    result, ours, theirs, exact = svd_refactoring_and_peft_svd(tmp_path, tiny_base, peft_adapters, device=device)
    reports = {r.module: r for r in result.modules}
    assert sorted(ours) == sorted(theirs) == sorted(reports)
    for module in ours:
        torch.testing.assert_close(ours[module], theirs[module], atol=1e-5, rtol=1e-4, msg=module)
        error = float(torch.linalg.norm(exact[module] - ours[module]) / torch.linalg.norm(exact[module]))
        assert reports[module].rank == 3 and reports[module].relative_error == pytest.approx(error, rel=1e-4)
