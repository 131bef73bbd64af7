"""`factor_dense`: one dense update factored, for tests (the product factors same-shape batches:
`merge_engine.lora.svd.factor_dense_batch`)."""

from __future__ import annotations

import torch

from merge_engine.lora.svd import AUTO, Factors, factor_dense_batch, svd_device


def factor_dense(delta: torch.Tensor, *, rank: int | None, energy: float | None,
                 device: torch.device | None = None, method: str = AUTO) -> Factors:
    """One dense update factored on ``device`` (`factor_dense_batch` of one)."""
    device = device or svd_device()
    return factor_dense_batch(delta.to(device=device, dtype=torch.float32)[None], rank=rank, energy=energy,
                              method=method)[0]
