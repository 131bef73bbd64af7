"""torch DCP checkpoints of a model (`merge_engine.layouts.dcp_model`, ``torch_dcp``) and torch's
HuggingFaceStorageWriter rank files (`merge_engine.layouts.dcp_hf`, ``dcp_hf``), written by the real libraries
(the session's ``dcp_runs``: a tiny Qwen2 sharded by FSDP2 over 2 gloo ranks; Accelerate's own save_fsdp_model,
``torch.distributed.checkpoint.save``, ``HuggingFaceStorageWriter(save_distributed=True)``).

- each is `check`ed complete under its own layout (main before: "IncompleteCheckpoint: metadata.json missing" for
  a DCP folder, taken for a Megatron dist_ckpt; "neither model.safetensors.index.json nor a single safetensors
  file" for the rank files) and `merge`d bit for bit into weights transformers loads with the model's logits;
- discovery finds ``checkpoint-N`` and ``step-N`` run folders, complete; an HF Trainer step without config.json
  needs ``hf_model_path``;
- a step still being written (no ``.metadata``, a data file short of what ``.metadata`` says, a rank file missing
  or shorter than its header) is incomplete, never merged; what cannot be read is `UnsupportedLayout` naming the
  layout (optimizer state only); torchtitan's own names are the ``torchtitan`` layout's;
- a Megatron ``torch_dist`` folder stays ``megatron_dist``'s.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from merge_engine.cli import main as stepmerge
from merge_engine.errors import CorruptShard, IncompleteCheckpoint, UnsupportedLayout
from merge_engine.layouts import check_checkpoint, find_layout, listing_verdicts
from merge_engine.layouts.discovery import discover
from merge_engine.storage import FileEntry
from tests.release_checks import assert_model_logits, load_model

LAYOUT = {"accelerate": "torch_dcp", "torch_dcp": "torch_dcp", "dcp_hf": "dcp_hf"}


def _reference(step) -> dict[str, torch.Tensor]:
    return load_file(os.path.join(step.reference_dir, "state_dict.safetensors"))


def _merged(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for path in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(path)))
    return out


def _copy(step, tmp_path: Path) -> Path:
    target = tmp_path / "run" / Path(step.step_dir).name
    shutil.copytree(step.step_dir, target)
    return target


@pytest.mark.parametrize("writer", LAYOUT)
def test_a_dcp_step_is_checked_complete_and_merged_bit_for_bit(dcp_runs, tmp_path, writer):
    step = dcp_runs[writer]
    checkpoint = check_checkpoint(step.step_dir)
    assert checkpoint.layout == LAYOUT[writer] and checkpoint.parallel == {"world_size": 2}
    assert (checkpoint.hf_dir is None) == (writer == "accelerate")  # HF Trainer saves no config under SHARDED
    out = tmp_path / "out"
    args = ["merge", "--local_dir", step.step_dir, "--target_dir", str(out)]
    if writer == "accelerate":
        assert stepmerge(args) != 0 and not out.exists()  # no config: refused, nothing written
        args += ["--hf_model_path", step.reference_hf_dir]
    assert stepmerge(args) == 0
    copied = sorted(p.name for p in out.iterdir() if p.name == ".metadata" or p.suffix == ".distcp")
    assert not copied, copied  # a DCP save with its config beside it: the checkpoint is not metadata to copy
    reference, merged = _reference(step), _merged(out)
    assert sorted(merged) == sorted(reference)
    for name, tensor in reference.items():
        assert merged[name].dtype == tensor.dtype and torch.equal(merged[name], tensor), name
    assert_model_logits(str(out), load_model(step.reference_hf_dir))  # transformers: the same logits, exactly


def test_accelerate_keys_lose_their_model_wrapper_by_dcp_own_record(dcp_runs):
    """Accelerate saves ``{"model": state_dict}``: DCP records the path of every flattened key, so
    ``model.model.embed_tokens.weight`` is ``model.embed_tokens.weight``, while the bare save keeps its names."""
    from merge_engine.formats.dcp_index import read_index
    from merge_engine.layouts.dcp_model import model_names

    wrapped = read_index(os.path.join(dcp_runs["accelerate"].step_dir, "pytorch_model_fsdp_0"))
    bare = read_index(dcp_runs["torch_dcp"].step_dir)
    assert "model.model.embed_tokens.weight" in wrapped.tensors
    assert set(model_names(wrapped, "w")) == set(bare.tensors) == set(model_names(bare, "b"))
    assert model_names(wrapped, "w")["lm_head.weight"] == "model.lm_head.weight"


@pytest.mark.parametrize("writer", LAYOUT)
def test_discovery_finds_the_trainers_step_folders(dcp_runs, writer):
    step = dcp_runs[writer]
    (found,) = discover(str(Path(step.step_dir).parent)).steps
    assert (found.step, found.layout, found.status) == (1, LAYOUT[writer], "complete")
    assert found.needs == (("hf_model_path",) if writer == "accelerate" else ())


def test_a_dcp_folder_without_metadata_is_still_being_written(dcp_runs, tmp_path):
    step = _copy(dcp_runs["accelerate"], tmp_path)
    (step / "pytorch_model_fsdp_0" / ".metadata").unlink()
    (found,) = discover(str(step.parent)).steps
    assert (found.layout, found.status) == ("torch_dcp", "incomplete")
    with pytest.raises(IncompleteCheckpoint):
        check_checkpoint(str(step))


@pytest.mark.parametrize("damage", ["truncated", "missing"])
def test_a_data_file_short_of_the_metadata_is_incomplete(dcp_runs, tmp_path, damage):
    step = _copy(dcp_runs["torch_dcp"], tmp_path)
    data = step / "__1_0.distcp"
    if damage == "missing":
        data.unlink()
    else:
        os.truncate(data, data.stat().st_size - 100)
    with pytest.raises(IncompleteCheckpoint) as caught:
        check_checkpoint(str(step))
    assert caught.value.path.endswith("__1_0.distcp")


def test_rank_files_of_the_hf_storage_writer_still_being_written_are_incomplete(dcp_runs, tmp_path):
    step = _copy(dcp_runs["dcp_hf"], tmp_path)
    rank_two = sorted(step.glob("shard-00002-*"))
    os.truncate(rank_two[0], rank_two[0].stat().st_size - 64)  # the writer is inside this file
    with pytest.raises(IncompleteCheckpoint):
        check_checkpoint(str(step))
    for path in rank_two:  # not started on output file 1 yet: the listing says so
        path.unlink()
    shards = [FileEntry(p.name, p.stat().st_size, "") for p in sorted(step.iterdir())]
    rank_one_only = [f for f in shards if not f.path.endswith("model-00002-of-00002.safetensors")]
    assert dict(listing_verdicts(rank_one_only))["dcp_hf"].status == "incomplete"


def test_optimizer_state_alone_is_a_named_refusal(dcp_runs):
    optimizer = os.path.join(dcp_runs["accelerate"].step_dir, "optimizer_0")
    with pytest.raises(UnsupportedLayout, match="torch_dcp: this DCP folder holds no model weights"):
        check_checkpoint(optimizer)


def test_torchtitan_names_are_torchtitan_s_layout(tmp_path):
    """torchtitan's model state flattened at the top with its own module names, saved by torch's DCP itself: the
    ``torchtitan`` layout (tests/merge_engine/layouts/test_torchtitan.py), never passed on under its own names."""
    import torch.distributed.checkpoint as dcp

    state = {"tok_embeddings.weight": torch.ones(8, 4), "layers.0.attention.wq.weight": torch.ones(4, 4),
             "norm.weight": torch.ones(4), "output.weight": torch.ones(8, 4)}
    dcp.save({**state, "optimizer": {"state": {"norm.weight": {"exp_avg": torch.zeros(4)}}}},
             checkpoint_id=str(tmp_path / "step-10"))
    assert check_checkpoint(str(tmp_path / "step-10")).layout == "torchtitan"


def test_items_saved_through_a_stream_transform_are_refused_by_the_layouts_name(tmp_path):
    """torch's DCP writer records a compressed item (its ``_extensions``, e.g. ZStandard) by the transforms in the
    item's storage record: refused in one line that starts with the layout's name, as its other refusals do."""
    import dataclasses
    import pickle

    import torch.distributed.checkpoint as dcp

    step = tmp_path / "checkpoint-1"
    dcp.save({"model.embed_tokens.weight": torch.ones(8, 4), "lm_head.weight": torch.ones(8, 4)},
             checkpoint_id=str(step))
    with open(step / ".metadata", "rb") as f:  # torch's own record of the save, read here by the test only
        metadata = pickle.load(f)
    metadata.storage_data = {index: dataclasses.replace(info, transform_descriptors=["zstd"])
                             for index, info in metadata.storage_data.items()}
    (step / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(UnsupportedLayout, match=r"^torch_dcp: '(model\.embed_tokens|lm_head)\.weight' is stored "
                                                r"with transforms \['zstd'\] \(compression\?\); not supported \["):
        check_checkpoint(str(step))


def test_a_megatron_torch_dist_folder_is_not_taken_for_a_plain_dcp_save():
    """megatron-core writes common.pt before the DCP save and metadata.json after it."""
    names = ["common.pt", "__0_0.distcp", "__1_0.distcp", ".metadata"]
    files = [FileEntry(name, 10, "") for name in names]
    assert find_layout("x", files).name == "megatron_dist"
    assert find_layout("x", files[1:]).name == "torch_dcp"
    with_config = [*files, FileEntry("metadata.json", 10, "")]
    assert [name for name, _ in listing_verdicts(with_config)] == ["megatron_dist"]


def test_a_forged_metadata_runs_nothing(dcp_runs, tmp_path):
    import pickle

    step = _copy(dcp_runs["torch_dcp"], tmp_path)

    class Boom:
        def __reduce__(self):
            return (os.system, ("touch " + str(tmp_path / "ran"),))

    (step / ".metadata").write_bytes(pickle.dumps(Boom()))
    with pytest.raises(CorruptShard):
        check_checkpoint(str(step))
    assert not (tmp_path / "ran").exists()


def test_a_consolidated_hf_storage_save_is_read_from_its_rank_files(tmp_path):
    """``HuggingFaceStorageWriter(enable_consolidation=True)`` (torchtitan's last HF save): rank files in ``sharded/``,
    torch's consolidated files and index beside them, no config: discovered complete, read from ``sharded/``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    from merge_engine.layouts import open_checkpoint

    state = {"model.embed_tokens.weight": torch.arange(32.0).reshape(8, 4), "lm_head.weight": torch.ones(8, 4)}
    step = tmp_path / "run" / "step-5"
    dcp.save(state, storage_writer=HuggingFaceStorageWriter(str(step), save_distributed=True,
                                                            enable_consolidation=True))
    assert (step / "model.safetensors.index.json").exists() and list((step / "sharded").iterdir())
    (found,) = discover(str(tmp_path / "run")).steps
    assert (found.step, found.layout, found.status) == (5, "dcp_hf", "complete")
    source = open_checkpoint(check_checkpoint(str(step)))
    try:
        assert {name: source.read(name) for name in source.metas()}.keys() == state.keys()
        assert all(torch.equal(source.read(name), value) for name, value in state.items())
    finally:
        source.close()


def test_a_nemo_rl_step_is_found_in_its_policy_folder(dcp_runs, tmp_path):
    """NeMo-RL saves ``{"model": ModelState}`` by DCP into ``step_N/policy/weights/`` (a ``tmp_step_N`` renamed once
    saved), its optimizer into ``policy/optimizer/``; the DCP files here are Accelerate's, which share that shape."""
    model = Path(dcp_runs["accelerate"].step_dir) / "pytorch_model_fsdp_0"
    run = tmp_path / "run"
    shutil.copytree(model, run / "step_3" / "policy" / "weights")
    shutil.copytree(model, run / "tmp_step_4" / "policy" / "weights")  # still being saved: no step yet
    (found,) = discover(str(run)).steps
    assert (found.step, found.role, found.layout, found.status) == (3, "policy", "torch_dcp", "complete")
    assert found.needs == ("hf_model_path",)
    checkpoint = check_checkpoint(found.url)
    assert checkpoint.notes == ("NeMo-RL DTensor policy",) and checkpoint.parallel == {"world_size": 2}
