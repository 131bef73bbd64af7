"""FSDP2 over tensor parallelism: 2-D DTensor placements on a (dp_shard, tp) mesh.

Specification (the checkpoint is written by real torch.distributed on CPU, gloo, world 4 = 2 x 2):
- the rank files hold what such a run saves: column-wise projections as (_StridedShard(0), Shard(0)),
  row-wise as (Shard(0), Shard(1)), the other parameters Shard(0) on the dp_shard sub-mesh (so two
  ranks hold each block: replicas over tp);
- the merge is exact, bit for bit, against the full model it was sharded from (the family matrix
  in test_hub_format checks names, load and logits of the same checkpoint);
- a rank file copied over another (a block held by the wrong number of ranks) is refused.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file

from merge_engine.errors import CorruptShard
from merge_engine.commands.merge import merge_checkpoint
from merge_engine.storage import RangeReader
from merge_engine.formats.torch_archive import TorchArchive

CASE = "qwen2_tp_w4"


def _placements(path: str, key: str) -> list[tuple[str, dict]]:
    tree = TorchArchive(path, RangeReader(path)).load()
    spec = tree[key].state["_spec"]
    return [(p.qualname, dict(p.fields)) for p in spec.fields["placements"]]


def test_rank_files_hold_two_dimensional_placements(family_runs):
    step = family_runs[CASE].latest
    rank0 = step.model_files[0]
    assert _placements(rank0, "model.layers.0.self_attn.q_proj.weight") == [
        ("_StridedShard", {"dim": 0, "split_factor": 2}), ("Shard", {"dim": 0})]
    assert _placements(rank0, "model.layers.0.self_attn.o_proj.weight") == [("Shard", {"dim": 0}), ("Shard", {"dim": 1})]
    assert _placements(rank0, "model.embed_tokens.weight") == [("Shard", {"dim": 0})]


def test_merge_is_exact(family_runs, tmp_path):
    step = family_runs[CASE].latest
    merge_checkpoint(step.checkpoint_dir, str(tmp_path / "out"))
    written = load_file(str(tmp_path / "out" / "model.safetensors"))
    reference = load_file(step.reference_state_dict)
    assert sorted(written) == sorted(reference)
    for name, tensor in reference.items():
        assert written[name].dtype == tensor.dtype and torch.equal(written[name], tensor), name


def test_a_rank_file_copied_over_another_is_refused(family_runs, tmp_path):
    step = family_runs[CASE].latest
    run = tmp_path / "actor"
    shutil.copytree(step.checkpoint_dir, run)
    shutil.copyfile(run / "model_world_size_4_rank_1.pt", run / "model_world_size_4_rank_2.pt")
    with pytest.raises(CorruptShard):
        merge_checkpoint(str(run), str(tmp_path / "out"))
