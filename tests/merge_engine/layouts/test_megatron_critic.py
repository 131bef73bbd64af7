"""verl's Megatron critics with tensor parallelism: the value head is replicated, not cut.

Specification:
- verl's critic value head (``output_layer`` of ONE row, a plain linear layer) is stored whole on
  every TP rank. A legacy checkpoint with TP 2 whose every rank holds the same one-row head merges
  to a token-classification model whose ``score.weight`` is that row (gathering it as a
  vocabulary cut gave 2 rows and "fewer than vocab_size");
- rank copies that differ are `CorruptShard` naming a rank file, and nothing is left at the target.

The checkpoint: a fixture's reference model split to TP 2 (legacy), each rank's ``output_layer``
replaced by the value head, as verl's critic saves it.
"""

from __future__ import annotations

import os

import pytest
import torch

from merge_engine.errors import CorruptShard
from merge_engine.commands.merge import merge_checkpoint
from merge_engine.output.jobs import OutputOptions
from merge_engine.commands.split import split_hf_to_megatron
from synthetic_runs.megatron import REFERENCE_HF_DIR
from tests.merge_engine.layouts.test_megatron_merge import _tensors

TP = 2


def _critic(megatron_runs, tmp_path, heads: list[torch.Tensor]) -> str:
    """The llama fixture's reference model as a TP-2 legacy critic; rank t holds ``heads[t]``."""
    reference = str(megatron_runs["llama_tp1_pp1_legacy"].reference_dir / REFERENCE_HF_DIR)
    url = str(tmp_path / "critic")
    split_hf_to_megatron(reference, url, OutputOptions(tp=TP))
    for t, head in enumerate(heads):
        path = os.path.join(url, "model", f"mp_rank_{t:02d}", "model.pt")
        chunks = torch.load(path, weights_only=True)  # written by this test's split
        assert chunks[-1]["output_layer.weight"].shape[0] > 1  # a vocabulary piece before the patch
        chunks[-1]["output_layer.weight"] = head
        torch.save(chunks, path)
    return url


def _hidden(megatron_runs) -> int:
    return megatron_runs["llama_tp1_pp1_legacy"].spec.hidden_size


def test_replicated_value_head_becomes_score(megatron_runs, tmp_path):
    generator = torch.Generator().manual_seed(3)
    head = torch.randn(1, _hidden(megatron_runs), generator=generator, dtype=torch.float32)
    url = _critic(megatron_runs, tmp_path, [head.clone() for _ in range(TP)])
    result = merge_checkpoint(url, str(tmp_path / "merged"), OutputOptions(backend="megatron"))
    merged = _tensors(str(tmp_path / "merged"))
    assert result.layout == "megatron_legacy"
    assert torch.equal(merged["score.weight"], head) and "lm_head.weight" not in merged


def test_value_head_copies_that_differ_are_refused(megatron_runs, tmp_path):
    head = torch.ones(1, _hidden(megatron_runs))
    url = _critic(megatron_runs, tmp_path, [head, head * 2])
    target = tmp_path / "merged"
    with pytest.raises(CorruptShard, match="differs between ranks") as info:
        merge_checkpoint(url, str(target), OutputOptions(backend="megatron"))
    assert "mp_rank_01" in info.value.path
    assert not target.exists()
