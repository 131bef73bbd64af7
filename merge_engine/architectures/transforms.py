"""The tensor math of Megatron <-> Hugging Face conversion: small pure functions, each with its inverse.

Every function here takes and returns plain tensors, reads no file and knows no name; the tables
(`merge_engine.architectures.mappings`) decide which function applies to which tensor.

- QKV: Megatron's ``linear_qkv`` stores rows per query group ``[q heads of group g; k_g; v_g]`` for
  g in groups (GQA: ``heads / kv_heads`` query heads per group). Hugging Face keeps three tensors.
- Gate/up: Megatron's gated ``linear_fc1`` (global view) is ``[all gate rows; all up rows]``.
- Vocabulary: Megatron pads the vocabulary to a multiple of ``make_vocab_size_divisible_by * tp``;
  Hugging Face keeps exactly ``config.vocab_size`` rows.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported by the functions that build tensors: the family tables load without torch
    import torch


def split_qkv(fused: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``linear_qkv`` (weight ``[(h + 2 kv) d, hidden]`` or bias ``[(h + 2 kv) d]``) -> q, k, v.

    Raises ValueError when the row count does not fit the head counts.
    """
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads do not divide into {num_kv_heads} groups")
    per_group = num_heads // num_kv_heads
    rows = (num_heads + 2 * num_kv_heads) * head_dim
    if fused.shape[0] != rows:
        raise ValueError(f"fused QKV has {fused.shape[0]} rows; {num_heads} heads, {num_kv_heads} KV heads "
                         f"of dim {head_dim} need {rows}")
    rest = tuple(fused.shape[1:])
    grouped = fused.reshape(num_kv_heads, per_group + 2, head_dim, *rest)
    q = grouped[:, :per_group].reshape(num_heads * head_dim, *rest)
    k = grouped[:, per_group].reshape(num_kv_heads * head_dim, *rest)
    v = grouped[:, per_group + 1].reshape(num_kv_heads * head_dim, *rest)
    return q.contiguous(), k.contiguous(), v.contiguous()


def merge_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_heads: int, num_kv_heads: int,
              head_dim: int) -> torch.Tensor:
    """Inverse of `split_qkv`: q ``[h d, ...]``, k and v ``[kv d, ...]`` -> grouped ``linear_qkv``."""
    import torch

    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads do not divide into {num_kv_heads} groups")
    per_group = num_heads // num_kv_heads
    expected = {"q": num_heads * head_dim, "k": num_kv_heads * head_dim, "v": num_kv_heads * head_dim}
    for label, tensor in (("q", q), ("k", k), ("v", v)):
        if tensor.shape[0] != expected[label]:
            raise ValueError(f"{label} has {tensor.shape[0]} rows, expected {expected[label]}")
    rest = tuple(q.shape[1:])
    grouped = torch.cat([q.reshape(num_kv_heads, per_group, head_dim, *rest),
                         k.reshape(num_kv_heads, 1, head_dim, *rest),
                         v.reshape(num_kv_heads, 1, head_dim, *rest)], dim=1)
    return grouped.reshape((num_heads + 2 * num_kv_heads) * head_dim, *rest).contiguous()


def split_gate_up(fc1: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Gated ``linear_fc1`` ``[2 f, hidden]`` (global view) -> gate ``[f, hidden]``, up ``[f, hidden]``."""
    import torch

    if fc1.shape[0] % 2:
        raise ValueError(f"gated linear_fc1 has an odd row count {fc1.shape[0]}")
    gate, up = torch.chunk(fc1, 2, dim=0)
    return gate.contiguous(), up.contiguous()


def merge_gate_up(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Inverse of `split_gate_up`."""
    import torch

    if gate.shape != up.shape:
        raise ValueError(f"gate {tuple(gate.shape)} and up {tuple(up.shape)} differ in shape")
    return torch.cat([gate, up], dim=0)


def padded_vocab_size(vocab_size: int, tp: int = 1, divisible_by: int = 128) -> int:
    """Megatron-LM's rule: round up to a multiple of ``divisible_by * tp``."""
    multiple = divisible_by * tp
    return int(math.ceil(vocab_size / multiple) * multiple)


def trim_vocab(padded: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Drop Megatron's padding rows: the first ``vocab_size`` rows."""
    if padded.shape[0] < vocab_size:
        raise ValueError(f"{padded.shape[0]} vocabulary rows, fewer than vocab_size {vocab_size}")
    return padded[:vocab_size]


def pad_vocab(rows: torch.Tensor, padded_size: int) -> torch.Tensor:
    """Inverse of `trim_vocab` up to the padding's values: zero rows appended up to ``padded_size``."""
    import torch

    if padded_size < rows.shape[0]:
        raise ValueError(f"cannot pad {rows.shape[0]} rows down to {padded_size}")
    if padded_size == rows.shape[0]:
        return rows
    pad = torch.zeros((padded_size - rows.shape[0], *rows.shape[1:]), dtype=rows.dtype)
    return torch.cat([rows, pad], dim=0)
