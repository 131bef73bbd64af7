"""torch_dist checkpoints that hold more than the model: only model weights are merged.

Specification:
- `is_model_key` refuses optimizer state also under Megatron's ChainedOptimizer prefix
  (``chained_<i>.optimizer...``: MoE runs chain a dense and an expert optimizer), RNG and scheduler
  state, and extra states; model keys (also expert weights) pass;
- a real fixture's dist checkpoint rewritten with such keys added (same chunks, same bytes, plus
  ``chained_0`` / ``chained_1`` Adam moments of the dense and expert weights) merges to the same
  reference weights, bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from merge_engine import storage
from merge_engine.layouts.megatron_dist import is_model_key
from merge_engine.commands.merge import merge_checkpoint
from merge_engine.formats.torch_dcp import DcpFiles, DcpTensor
from merge_engine.formats.dcp_index import read_index
from merge_engine.output.jobs import OutputOptions
from tests.merge_engine.formats.dcp_writer import DcpWriter, read_object
from synthetic_runs.megatron import REFERENCE_HF_DIR
from tests.merge_engine.layouts.test_megatron_bad_input import _copy
from tests.merge_engine.layouts.test_megatron_merge import _tensors

EXPERT_FC1 = "decoder.layers.mlp.experts.experts.linear_fc1.weight"
QKV = "decoder.layers.self_attention.linear_qkv.weight"


@pytest.mark.parametrize("key, model", [
    ("decoder.layers.self_attention.linear_qkv.weight", True),
    (EXPERT_FC1, True),
    ("embedding.word_embeddings.weight", True),
    ("optimizer.state.exp_avg.decoder.layers.self_attention.linear_qkv.weight", False),
    (f"chained_0.optimizer.state.exp_avg.{QKV}", False),
    (f"chained_1.optimizer.state.exp_avg_sq.{EXPERT_FC1}", False),
    ("chained_12.optimizer.distributed.dp_group_idx_0.gbuf_idx_0.dtype_(torch.float32, torch.float32).param", False),
    ("rng_state", False),
    ("decoder.layers.self_attention.linear_qkv._extra_state", False),
])
def test_model_keys(key, model):
    assert is_model_key(key) is model


def _rewrite_with(folder: str, extra: dict[str, torch.Tensor]) -> None:
    """Rewrite the DCP folder with the same chunks and entries, plus ``extra`` whole tensors."""
    index = read_index(folder)
    files = DcpFiles(folder, {e.path: e.size for e in storage.list_files(folder)})
    try:
        chunks = [(key, info.shape, c.offsets, DcpTensor(key, info, files).read_box(c.offsets, c.sizes))
                  for key, info in index.tensors.items() for c in info.chunks]
        objects = [(key, read_object(folder, location)) for key, location in index.objects.items()]
    finally:
        files.close()
    for entry in storage.list_files(folder):
        if entry.path.endswith(".distcp"):
            storage.remove(storage.join(folder, entry.path))
    writer = DcpWriter(folder)
    for key, shape, offsets, tensor in chunks:
        writer.add_chunk(key, shape, offsets, tensor)
    for key, data in objects:
        writer.add_object(key, data)
    for key, tensor in extra.items():
        writer.add_chunk(key, tensor.shape, (0,) * tensor.dim(), tensor)
    writer.close()


def test_chained_optimizer_state_is_not_merged(megatron_runs, tmp_path):
    """A MoE dist_ckpt (verl v1: model and optimizer in one folder) with ChainedOptimizer moments."""
    job, url = _copy(megatron_runs, "qwen3_moe_pp2_ep2_dist_v1", tmp_path)
    folder = str(job.step_dir / "actor" / "dist_ckpt")
    index = read_index(folder)
    extra = {}
    for i, (name, key) in enumerate([("exp_avg", QKV), ("exp_avg_sq", EXPERT_FC1)]):
        extra[f"chained_{i}.optimizer.state.{name}.{key}"] = torch.ones(index.tensors[key].shape, dtype=torch.float32)
    _rewrite_with(folder, extra)
    assert set(extra) <= set(read_index(folder).tensors)
    target = tmp_path / "merged"
    merge_checkpoint(url, str(target), OutputOptions(backend="megatron"))
    reference = _tensors(str(job.reference_dir / REFERENCE_HF_DIR))
    ours = _tensors(str(target))
    assert set(ours) == set(reference)
    for name, value in reference.items():
        assert ours[name].dtype == value.dtype and torch.equal(ours[name], value), name
