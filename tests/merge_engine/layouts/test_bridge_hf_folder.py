"""Megatron-Bridge's ``iter_N/hf/`` (Hugging Face weights the trainer wrote beside its native ``torch_dist``
checkpoint) is read as a bridge export: verified (index, headers, every tensor the config implies) and passed
through, never rebuilt from the Megatron state; while the native checkpoint is still being written the step is
incomplete, once it is whole the step is complete.

The folder is assembled here (no Megatron-Bridge runs on these machines): ``hf/`` is transformers'
``save_pretrained`` of a known model; beside it the native checkpoint's file names (``common.pt``, ``metadata.json``
and DCP's ``.metadata`` / ``__0_0.distcp``).
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from merge_engine.cli import main
from merge_engine.errors import IncompleteCheckpoint
from merge_engine.layouts import check_checkpoint, listing_verdicts
from merge_engine.layouts.discovery import discover
from merge_engine.storage import list_files
from synthetic_runs.models import ModelSpec, build_model, write_hf_metadata


def write_bridge_step(step):
    """A Megatron-Bridge ``iter_N/`` folder: ``hf/`` saved by transformers beside native checkpoint files without
    their ``.metadata`` (not yet whole); returns the model ``hf/`` holds."""
    model = build_model(ModelSpec(), seed=5)
    model.save_pretrained(step / "hf")
    write_hf_metadata(step / "hf", ModelSpec())
    for name in ("common.pt", "__0_0.distcp"):
        (step / name).write_bytes(b"x" * 64)
    return model


@pytest.fixture
def bridge_run(tmp_path):
    step = tmp_path / "run" / "iter_0000005"
    return step, write_bridge_step(step)


def test_a_bridge_hf_folder_is_verified_and_passed_through(bridge_run, tmp_path):
    step, model = bridge_run
    verdicts = dict(listing_verdicts(list_files(str(step), recursive=True)))
    assert verdicts["megatron_bridge"].status == "incomplete"  # the native checkpoint has no .metadata yet
    with pytest.raises(IncompleteCheckpoint):
        check_checkpoint(str(step))
    (step / ".metadata").write_bytes(b"m")
    (step / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
    (found,) = discover(str(step.parent)).steps
    assert (found.step, found.status, found.layout) == (5, "complete", "megatron_bridge")
    checkpoint = check_checkpoint(str(step))
    assert checkpoint.layout == "megatron_bridge" and checkpoint.hf_dir.endswith("/hf")
    target = tmp_path / "out"
    assert main(["merge", "--local_dir", str(step), "--target_dir", str(target)]) == 0
    written = load_file(str(target / "model.safetensors"))
    reference = model.state_dict()
    assert set(written) == set(reference) and all(torch.equal(written[k], reference[k]) for k in reference)


def test_a_bridge_hf_folder_missing_a_tensor_is_refused(bridge_run):
    step, _ = bridge_run
    (step / ".metadata").write_bytes(b"m")
    (step / "metadata.json").write_text("{}")
    weights = load_file(str(step / "hf" / "model.safetensors"))
    weights.pop("model.layers.1.mlp.up_proj.weight")
    from safetensors.torch import save_file

    save_file(weights, str(step / "hf" / "model.safetensors"))
    with pytest.raises(IncompleteCheckpoint, match="lacks 1 tensor"):
        check_checkpoint(str(step))
