"""How Megatron cuts each tensor across tensor-parallel (TP) ranks: one rule per module, both directions.

The rules key on Megatron module names, which are the same in every model family:

============================  =============  =========================================
module                        kind           full tensor from the TP pieces
============================  =============  =========================================
word_embeddings, output_layer  column         concatenate rows (vocabulary)
linear_qkv (weight, bias)      column         concatenate rows (whole query groups)
linear_fc1 (gated MLP)         gated column   each rank holds [its gate rows; its up rows]:
                                              all gates, then all ups
linear_fc1 (plain MLP)         column         concatenate rows
linear_q_up_proj,              column         concatenate rows (whole heads; multi-latent
  linear_kv_up_proj, linear_q_proj              attention)
linear_q_down_proj,            column         concatenate rows: megatron-core's local spec
  linear_kv_down_proj           (local) or    (ColumnParallelLinear, outputs gathered), what
                                replicated     `split_tp` writes; TransformerEngine's spec
                                (TE)           duplicates them on every rank (TELinear
                                               "duplicated"): `mla_down_projection_kind`
eh_proj (MTP layers)           column         concatenate rows
linear_proj, linear_fc2        row            concatenate columns (dim 1)
anything else                  replicated     identical on every rank (norms, router, biases
                                              of row-parallel layers, shared-expert gate)
output_layer of ONE row        replicated     verl's critic value head (a plain linear
  on every rank                               layer, not a vocabulary cut)
============================  =============  =========================================

`split_tp` cuts a full tensor into the ranks' pieces (HF -> Megatron); readers of per-rank files
build the inverse gather lazily from the same `tp_kind`.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the TP rules are read by a check (no torch); the tensor functions import it
    import torch


class TPKind(enum.Enum):
    COLUMN = "column"
    ROW = "row"
    GATED_COLUMN = "gated_column"
    REPLICATED = "replicated"


OUTPUT_LAYER = "output_layer.weight"
VALUE_HEAD_ROWS = 1  # verl's critic: output_layer = Linear(hidden, 1), the same on every TP rank

# (name suffix, kind); ``linear_fc1`` is resolved to gated or plain by `tp_kind`.
TP_RULES: tuple[tuple[str, TPKind], ...] = (
    ("word_embeddings.weight", TPKind.COLUMN),
    (OUTPUT_LAYER, TPKind.COLUMN),
    ("linear_qkv.weight", TPKind.COLUMN),
    ("linear_qkv.bias", TPKind.COLUMN),
    ("linear_q_proj.weight", TPKind.COLUMN),
    ("eh_proj.weight", TPKind.COLUMN),  # an MTP layer's projection of [embedding; hidden]
    ("linear_q_up_proj.weight", TPKind.COLUMN),
    ("linear_kv_up_proj.weight", TPKind.COLUMN),
    ("linear_q_down_proj.weight", TPKind.COLUMN),  # local spec; TE duplicates: `mla_down_projection_kind`
    ("linear_kv_down_proj.weight", TPKind.COLUMN),
    ("linear_fc1.weight", TPKind.GATED_COLUMN),
    ("linear_fc1.bias", TPKind.GATED_COLUMN),
    ("linear_proj.weight", TPKind.ROW),
    ("linear_fc2.weight", TPKind.ROW),
)


def tp_kind(name: str, gated: bool = True, piece_rows: Sequence[int] = ()) -> TPKind:
    """The TP rule of a Megatron tensor name; ``gated`` says whether ``linear_fc1`` is a gated (SwiGLU) MLP.

    ``piece_rows`` (each TP rank's row count, when the pieces are known): an ``output_layer`` of
    one row on every one of several ranks is a critic's value head, replicated, not a vocabulary cut.
    """
    if name.endswith(OUTPUT_LAYER) and len(piece_rows) > 1 and all(r == VALUE_HEAD_ROWS for r in piece_rows):
        return TPKind.REPLICATED
    for suffix, kind in TP_RULES:
        if name.endswith(suffix):
            if kind is TPKind.GATED_COLUMN and not gated:
                return TPKind.COLUMN
            return kind
    return TPKind.REPLICATED


MLA_Q_DOWN = "linear_q_down_proj.weight"
MLA_KV_DOWN = "linear_kv_down_proj.weight"
MLA_Q_UP = "linear_q_up_proj.weight"
MLA_TE_NORMS = ("linear_q_up_proj.layer_norm_weight", "linear_kv_up_proj.layer_norm_weight")


def mla_down_projection_kind(q_down_rows: Sequence[int] | None, q_lora_rank: int | None, te_names: bool) -> TPKind:
    """How one layer's MLA down-projections (q and kv alike: one spec built both) are held by the TP
    ranks of a per-rank checkpoint: cut in row pieces (megatron-core's local spec) or duplicated
    (TransformerEngine's).

    Decided from shapes when the layer has a q down-projection: each rank's rows (``q_down_rows``)
    against ``q_lora_rank`` (the in-features of ``linear_q_up_proj``): all of them -> REPLICATED, a
    1/TP share -> COLUMN, anything else `ValueError`. Without one (no q low-rank), from the names:
    TE's fused low-rank norms (``te_names``, `MLA_TE_NORMS`) -> REPLICATED, else COLUMN.
    """
    if q_down_rows and q_lora_rank:
        tp = len(q_down_rows)
        if all(rows == q_lora_rank for rows in q_down_rows):
            return TPKind.REPLICATED
        if all(rows * tp == q_lora_rank for rows in q_down_rows):
            return TPKind.COLUMN
        raise ValueError(f"q down-projection pieces of {list(q_down_rows)} rows fit neither q_lora_rank={q_lora_rank} "
                         f"on every TP rank (duplicated) nor 1/{tp} of it on each (column-parallel)")
    return TPKind.REPLICATED if te_names else TPKind.COLUMN


def is_gated_fc1(fc1_rows: int, fc2_cols: int) -> bool:
    """A gated MLP's ``linear_fc1`` has twice the rows of ``linear_fc2``'s columns (per rank or global)."""
    if fc1_rows == 2 * fc2_cols:
        return True
    if fc1_rows == fc2_cols:
        return False
    raise ValueError(f"linear_fc1 with {fc1_rows} rows fits neither a gated nor a plain MLP with linear_fc2 "
                     f"of {fc2_cols} columns")


def split_tp(tensor: torch.Tensor, kind: TPKind, tp: int) -> list[torch.Tensor]:
    """The ``tp`` pieces rank r holds of a full tensor (replicated: ``tp`` references to it)."""
    import torch

    if tp == 1 or kind is TPKind.REPLICATED:
        return [tensor] * tp
    if kind is TPKind.ROW:
        return _even_chunks(tensor, tp, 1)
    if kind is TPKind.COLUMN:
        return _even_chunks(tensor, tp, 0)
    gate, up = _even_chunks(tensor, 2, 0)
    return [torch.cat([g, u], dim=0) for g, u in zip(_even_chunks(gate, tp, 0), _even_chunks(up, tp, 0))]


def _even_chunks(tensor: torch.Tensor, parts: int, dim: int) -> list[torch.Tensor]:
    import torch

    if tensor.shape[dim] % parts:
        raise ValueError(f"dimension {dim} of size {tensor.shape[dim]} does not split into {parts} equal parts")
    return [c.contiguous() for c in torch.chunk(tensor, parts, dim=dim)]
