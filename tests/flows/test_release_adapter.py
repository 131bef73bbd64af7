"""release_adapter: a step's LoRA adapter extracted to PEFT, validated by loading it, published.

On a run root with only the LoRA step: the adapter release holds adapter_config.json (r and alpha
from the run), adapter_model.safetensors and the clean base under base/; PEFT loads it (real
`PeftModel.from_pretrained`). A later merge_step of the same step publishes the trained model and
finds the adapter already released. A step without LoRA is refused with a named error.
"""

from __future__ import annotations

import pytest

from flows.merge_step import merge_step
from flows.params import AdapterParams, MergeStepParams
from flows.release_adapter import release_adapter
from merge_engine.errors import AdapterError
from merge_engine.publish import read_manifest, verify_release
from tests.fixtures_pipeline import LORA_STEP, copy_steps


def test_the_adapter_of_a_lora_step_is_released_and_loads_with_peft(prefect, template_run, tmp_path):
    run_root = str(tmp_path / "run")
    copy_steps(template_run, run_root, [LORA_STEP])
    staging = str(tmp_path / "staging")
    outcome = release_adapter(AdapterParams(run_root=run_root, step=LORA_STEP, staging_root=staging))
    (adapter,) = outcome.releases
    assert outcome.status == "published" and adapter.kind == "adapter"
    assert verify_release(adapter.url).ok
    checks = {c["name"]: c["ok"] for c in read_manifest(adapter.url).validation["checks"]}
    assert checks["peft_load"] and checks["adapter_fits_base"] and checks["adapter_finite"]
    assert "peft_logits" not in checks  # no merged model released yet to compare with

    full = merge_step(MergeStepParams(run_root=run_root, step=LORA_STEP, staging_root=staging))
    kinds = {r.kind: r for r in full.releases}
    assert not kinds["model"].already_published and kinds["adapter"].already_published
    assert kinds["adapter"].url == adapter.url


def test_a_step_without_lora_is_refused(prefect, template_run, tmp_path):
    run_root = str(tmp_path / "run")
    copy_steps(template_run, run_root, [1])
    state = release_adapter(AdapterParams(run_root=run_root, step=1), return_state=True)
    with pytest.raises(AdapterError):
        state.result()
