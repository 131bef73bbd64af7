"""DeepSeek-V3 (multi-latent attention) at tensor parallelism 2, in per-rank (legacy) files.

megatron-core's local spec cuts MLA's low-rank down-projections (``linear_q_down_proj``,
``linear_kv_down_proj``) in row pieces over the TP ranks like any ColumnParallelLinear (their outputs
are gathered before the low-rank norms); TransformerEngine's spec duplicates them on every rank
(``TELinear(parallel_mode="duplicated")``) and fuses the low-rank norms into the up-projections
(``linear_q_up_proj.layer_norm_weight``). Specification:
- the real megatron-core TP 2 fixtures (``deepseek_v3_tp2_ep2_legacy``, ``deepseek_v3_tp2_pp2_dist_v1``)
  merge bit for bit with logits equal to megatron-core's (the matrix tests in
  ``test_megatron_merge.py``; the split of TP 2 loads back into megatron-core in ``test_split.py``);
- the same checkpoint in TransformerEngine's layout (down-projections duplicated on both ranks, fused
  norm names; the MTP layer's too) merges to the same bytes (the MTP layer dropped: the reference
  model has none; its TP 2 export is checked in ``test_megatron_merge.py``);
- which of the two a file holds is decided from the q down-projection's row count against
  ``q_lora_rank`` (`mla_down_projection_kind`): pieces that fit neither are a `CorruptShard`
  naming the file, nothing is written; duplicated pieces that differ are refused while read.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from merge_engine.architectures.parallel import TPKind, mla_down_projection_kind
from merge_engine.errors import CorruptShard
from merge_engine.commands.merge import merge_checkpoint
from merge_engine.output.jobs import OutputOptions
from synthetic_runs.megatron import REFERENCE_HF_DIR
from tests.merge_engine.layouts.test_megatron_merge import _tensors

FIXTURE = "deepseek_v3_tp2_ep2_legacy"
DOWN = ("linear_q_down_proj.weight", "linear_kv_down_proj.weight")
TE_NORMS = {"q_layernorm.weight": "linear_q_up_proj.layer_norm_weight",
            "kv_layernorm.weight": "linear_kv_up_proj.layer_norm_weight"}


def _rank_files(actor: Path) -> dict[str, Path]:
    return {p.parent.name: p for p in sorted((actor / "model").glob("mp_rank_*/model.pt"))}


def _rewrite(actor: Path, edit) -> None:
    """Apply ``edit({tp: chunk 0 state})`` to the TP rank files of every (pp, ep) cell, in place."""
    files = _rank_files(actor)
    cells: dict[str, dict[int, Path]] = {}
    for folder, path in files.items():
        cells.setdefault(folder[len("mp_rank_00"):], {})[int(folder[len("mp_rank_"):len("mp_rank_00")])] = path
    for paths in cells.values():
        states = {t: torch.load(path, weights_only=True) for t, path in paths.items()}
        edit({t: chunks[0] for t, chunks in states.items()})
        for t, path in paths.items():
            torch.save(states[t], path)


def _as_transformer_engine(states: dict[int, dict]) -> None:
    """TE's layout: every TP rank holds the whole down-projections; low-rank norms fused by name."""
    for key in [k for k in states[0] if k.endswith(DOWN)]:
        whole = torch.cat([states[t][key] for t in sorted(states)], dim=0)
        for state in states.values():
            state[key] = whole.clone()
    for state in states.values():
        for key in [k for k in state if k.endswith(tuple(TE_NORMS))]:
            local = next(n for n in TE_NORMS if key.endswith(n))
            state[key[: -len(local)] + TE_NORMS[local]] = state.pop(key)


@pytest.fixture
def checkpoint_copy(megatron_runs, tmp_path) -> Path:
    job = megatron_runs[FIXTURE]
    actor = tmp_path / "actor"
    shutil.copytree(job.step_dir / "actor", actor)
    return actor


def test_local_spec_pieces_are_cut_rows(megatron_runs):
    """The fixture is what megatron-core's local spec holds: each TP rank half of the down-projections."""
    files = _rank_files(megatron_runs[FIXTURE].step_dir / "actor")
    state = torch.load(files["mp_rank_00_000"], weights_only=True)[0]
    q_down = state["decoder.layers.0.self_attention.linear_q_down_proj.weight"]
    q_up = state["decoder.layers.0.self_attention.linear_q_up_proj.weight"]
    assert q_down.shape[0] * 2 == q_up.shape[1]  # q_lora_rank / TP rows on each rank


def test_transformer_engine_layout_merges_to_the_same_bytes(megatron_runs, checkpoint_copy, tmp_path):
    _rewrite(checkpoint_copy, _as_transformer_engine)
    state = torch.load(_rank_files(checkpoint_copy)["mp_rank_01_000"], weights_only=True)[0]
    assert "decoder.layers.0.self_attention.linear_q_up_proj.layer_norm_weight" in state
    merge_checkpoint(str(checkpoint_copy), str(tmp_path / "merged"), OutputOptions(backend="megatron", mtp_layers="drop"))
    reference = _tensors(str(megatron_runs[FIXTURE].reference_dir / REFERENCE_HF_DIR))
    merged = _tensors(str(tmp_path / "merged"))
    assert set(merged) == set(reference)
    assert all(torch.equal(merged[k], v) for k, v in reference.items())


def test_down_projection_pieces_that_fit_neither_layout_are_refused(checkpoint_copy, tmp_path):
    def cut(states):
        for state in states.values():
            key = "decoder.layers.1.self_attention.linear_q_down_proj.weight"
            state[key] = state[key][:-1].clone()

    _rewrite(checkpoint_copy, cut)
    with pytest.raises(CorruptShard, match="linear_q_down_proj") as refused:
        merge_checkpoint(str(checkpoint_copy), str(tmp_path / "merged"), OutputOptions(backend="megatron", mtp_layers="drop"))
    assert "mp_rank_00" in str(refused.value.path)
    assert not (tmp_path / "merged").exists()


def test_duplicated_pieces_that_differ_are_refused(checkpoint_copy, tmp_path):
    def diverge(states):
        _as_transformer_engine(states)
        states[1]["decoder.layers.0.self_attention.linear_kv_down_proj.weight"][0, 0] += 1.0

    _rewrite(checkpoint_copy, diverge)
    with pytest.raises(CorruptShard, match="differs between ranks"):
        merge_checkpoint(str(checkpoint_copy), str(tmp_path / "merged"), OutputOptions(backend="megatron", mtp_layers="drop"))
    assert not (tmp_path / "merged").exists()


@pytest.mark.parametrize("rows, rank, te, kind", [
    ((16, 16), 32, False, TPKind.COLUMN), ((32, 32), 32, False, TPKind.REPLICATED),
    ((32, 32), 32, True, TPKind.REPLICATED), ((8, 8, 8, 8), 32, False, TPKind.COLUMN),
    (None, None, True, TPKind.REPLICATED), (None, None, False, TPKind.COLUMN),
])
def test_mla_down_projection_kind(rows, rank, te, kind):
    assert mla_down_projection_kind(rows, rank, te) is kind


@pytest.mark.parametrize("rows", [(16, 15), (20, 20), (32, 16)])
def test_mla_down_projection_kind_refuses_other_rows(rows):
    with pytest.raises(ValueError, match="q_lora_rank=32"):
        mla_down_projection_kind(rows, 32, False)
