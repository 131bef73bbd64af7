"""The tensor math of Megatron <-> Hugging Face conversion, each function against its inverse.

Specification:
- `split_qkv` reads rows per query group ``[q heads of the group; k; v]`` (checked against an
  explicit per-head construction), for MHA, GQA and a single KV head, weights and biases;
  `merge_qkv` is its exact inverse; a row count that does not fit the head counts is refused;
- gate/up: ``[gate; up]`` split and merged back exactly;
- vocabulary: padding rows trimmed to ``vocab_size`` and zero-padded back; Megatron's padded size rule;
- TP rules: every kind splits into pieces a rank holds and gathers back exactly; gated ``linear_fc1``
  pieces are ``[gate slice; up slice]`` per rank; the rules key on Megatron module names;
  gated vs plain MLP is told apart from shapes.
"""

import pytest
import torch

from merge_engine.architectures import transforms
from merge_engine.architectures.parallel import TPKind, is_gated_fc1, split_tp, tp_kind

HIDDEN = 8
HEAD_CASES = [(4, 4, 2), (4, 2, 2), (4, 1, 3), (6, 3, 2)]  # (heads, kv_heads, head_dim)


def gather_tp(pieces: list[torch.Tensor], kind: TPKind) -> torch.Tensor:
    """Inverse of `split_tp`: the full tensor from rank 0..tp-1's pieces (replicated: checked identical)."""
    if kind is TPKind.REPLICATED or len(pieces) == 1:
        for other in pieces[1:]:
            if not torch.equal(other, pieces[0]):
                raise ValueError("replicated tensor differs between TP ranks")
        return pieces[0]
    if kind is TPKind.ROW:
        return torch.cat(pieces, dim=1)
    if kind is TPKind.COLUMN:
        return torch.cat(pieces, dim=0)
    halves = [p.chunk(2, dim=0) for p in pieces]
    return torch.cat([g for g, _ in halves] + [u for _, u in halves], dim=0)


def _per_head_layout(q, k, v, heads, kv_heads, d):
    """The grouped layout built head by head: for each group, its query heads, then k, then v."""
    rows = []
    per_group = heads // kv_heads
    for g in range(kv_heads):
        for h in range(g * per_group, (g + 1) * per_group):
            rows.append(q[h * d:(h + 1) * d])
        rows.append(k[g * d:(g + 1) * d])
        rows.append(v[g * d:(g + 1) * d])
    return torch.cat(rows)


class TestQKV:
    @pytest.mark.parametrize("heads,kv_heads,d", HEAD_CASES)
    @pytest.mark.parametrize("bias", [False, True])
    def test_split_matches_per_head_layout_and_merge_inverts(self, heads, kv_heads, d, bias):
        """Split of the grouped layout gives q, k, v exactly; merge gives the grouped layout back."""
        shape = (lambda rows: (rows,)) if bias else (lambda rows: (rows, HIDDEN))
        q, k, v = torch.randn(shape(heads * d)), torch.randn(shape(kv_heads * d)), torch.randn(shape(kv_heads * d))
        fused = _per_head_layout(q, k, v, heads, kv_heads, d)
        got = transforms.split_qkv(fused, heads, kv_heads, d)
        assert all(torch.equal(a, b) for a, b in zip(got, (q, k, v)))
        assert torch.equal(transforms.merge_qkv(q, k, v, heads, kv_heads, d), fused)

    def test_wrong_row_count_is_refused(self):
        with pytest.raises(ValueError, match="need 64"):
            transforms.split_qkv(torch.zeros(48, HIDDEN), 4, 2, 8)
        with pytest.raises(ValueError, match="k has"):
            transforms.merge_qkv(torch.zeros(32, 4), torch.zeros(8, 4), torch.zeros(16, 4), 4, 2, 8)


def test_gate_up_round_trip():
    """linear_fc1 = [gate; up]: split then merge is the identity; odd row counts are refused."""
    gate, up = torch.randn(6, HIDDEN), torch.randn(6, HIDDEN)
    fused = transforms.merge_gate_up(gate, up)
    assert torch.equal(fused[:6], gate) and torch.equal(fused[6:], up)
    a, b = transforms.split_gate_up(fused)
    assert torch.equal(a, gate) and torch.equal(b, up)
    with pytest.raises(ValueError):
        transforms.split_gate_up(torch.zeros(5, 2))


def test_vocab_padding_rule_trim_and_pad():
    """Megatron pads 1003 tokens to 1024 at TP 1-8 with divisor 128 (x TP), 1152 at TP 3."""
    assert transforms.padded_vocab_size(1003, 1) == 1024
    assert transforms.padded_vocab_size(1003, 2) == 1024
    assert transforms.padded_vocab_size(1003, 3) == 1152
    assert transforms.padded_vocab_size(1024, 1) == 1024
    rows = torch.randn(1003, 4)
    padded = transforms.pad_vocab(rows, 1024)
    assert padded.shape == (1024, 4) and not padded[1003:].any()
    assert torch.equal(transforms.trim_vocab(padded, 1003), rows)
    with pytest.raises(ValueError):
        transforms.trim_vocab(rows, 2000)


class TestTensorParallel:
    @pytest.mark.parametrize("kind", list(TPKind))
    @pytest.mark.parametrize("tp", [1, 2, 4])
    def test_split_gather_round_trip(self, kind, tp):
        full = torch.randn(16, 8)
        pieces = split_tp(full, kind, tp)
        assert len(pieces) == tp
        assert torch.equal(gather_tp(pieces, kind), full)

    def test_piece_shapes_per_kind(self):
        """Column: rows; row: columns; gated: each rank [its gate rows; its up rows]; replicated: whole."""
        full = torch.arange(16 * 8.0).reshape(16, 8)
        assert split_tp(full, TPKind.COLUMN, 2)[1].shape == (8, 8)
        assert split_tp(full, TPKind.ROW, 2)[1].shape == (16, 4)
        gated = split_tp(full, TPKind.GATED_COLUMN, 2)[1]
        assert torch.equal(gated, torch.cat([full[4:8], full[12:16]]))
        assert split_tp(full, TPKind.REPLICATED, 2)[1] is full

    def test_replicated_pieces_must_agree(self):
        with pytest.raises(ValueError, match="differs"):
            gather_tp([torch.zeros(3), torch.ones(3)], TPKind.REPLICATED)

    @pytest.mark.parametrize("name,gated,kind", [
        ("embedding.word_embeddings.weight", True, TPKind.COLUMN),
        ("output_layer.weight", True, TPKind.COLUMN),
        ("decoder.layers.3.self_attention.linear_qkv.weight", True, TPKind.COLUMN),
        ("decoder.layers.3.self_attention.linear_qkv.bias", True, TPKind.COLUMN),
        ("decoder.layers.3.self_attention.linear_proj.weight", True, TPKind.ROW),
        ("decoder.layers.3.mlp.linear_fc1.weight", True, TPKind.GATED_COLUMN),
        ("decoder.layers.3.mlp.linear_fc1.weight", False, TPKind.COLUMN),
        ("decoder.layers.3.mlp.experts.local_experts.7.linear_fc2.weight", True, TPKind.ROW),
        ("decoder.layers.3.mlp.router.weight", True, TPKind.REPLICATED),
        ("decoder.layers.3.input_layernorm.weight", True, TPKind.REPLICATED),
        ("decoder.layers.3.mlp.shared_experts.gate_weight", True, TPKind.REPLICATED),
    ])
    def test_rules_key_on_module_names(self, name, gated, kind):
        assert tp_kind(name, gated) is kind

    def test_one_row_output_layer_on_every_rank_is_a_replicated_value_head(self):
        """verl's critic head (one row per TP rank) is replicated; a vocabulary cut stays column."""
        assert tp_kind("output_layer.weight", piece_rows=(1, 1)) is TPKind.REPLICATED
        assert tp_kind("output_layer.weight", piece_rows=(64, 64)) is TPKind.COLUMN
        assert tp_kind("output_layer.weight", piece_rows=(1,)) is TPKind.COLUMN
        assert tp_kind("embedding.word_embeddings.weight", piece_rows=(1, 1)) is TPKind.COLUMN

    def test_gated_mlp_told_from_shapes(self):
        assert is_gated_fc1(224, 112) and not is_gated_fc1(112, 112)
        with pytest.raises(ValueError):
            is_gated_fc1(100, 112)
