"""What a full fine-tune changed: the modules an SVD extraction factors, and the other tensors that differ."""

from __future__ import annotations

import pytest
import torch

from merge_engine.errors import AdapterError
from merge_engine.lora.finetune_delta import changed_tensors, select_modules

class Chunked:
    """The one part of a TensorSource `changed_tensors` reads: each tensor's flat chunks of ``max_bytes``."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def iter_chunks(self, name: str, max_bytes: int):
        flat = self.tensors[name].reshape(-1)
        step = max(1, max_bytes // flat.element_size())
        return (flat[i:i + step] for i in range(0, flat.numel(), step))


CANDIDATES = ["model.embed_tokens", "model.layers.0.self_attn.q_proj", "model.layers.0.mlp.up_proj", "lm_head"]


def test_by_default_every_linear_weight_but_embeddings_and_heads():
    assert select_modules(CANDIDATES, None, None) == ["model.layers.0.self_attn.q_proj", "model.layers.0.mlp.up_proj"]


def test_targets_given_are_matched_and_one_matching_nothing_is_refused():
    assert select_modules(CANDIDATES, ["q_proj"], None) == ["model.layers.0.self_attn.q_proj"]
    with pytest.raises(AdapterError, match="o_proj"):
        select_modules(CANDIDATES, ["q_proj", "o_proj"], "s3://b/tuned")


def test_changed_tensors_names_each_difference_with_its_largest_size():
    base = {"a": torch.zeros(64), "b": torch.ones(8, 8)}
    tuned = {"a": torch.zeros(64), "b": torch.ones(8, 8)}
    tuned["b"][7, 7] = -2.0
    assert changed_tensors(Chunked(base), Chunked(tuned), ["a", "b"], chunk_bytes=32) == [("b", 3.0)]
