"""Low-rank factoring of weight updates: ``delta ~= B @ A`` with B (out, k), A (k, in).

- `factor_dense(delta, ...)`: a dense update (a full fine-tune minus its base) by a thin SVD.
- `factor_product(b, a, ...)`: an update already given as a product of thin factors (stacked
  adapters) -- QR of each factor, then the SVD of the small (R x R) core: exact, and it never forms
  the (out x in) matrix.
The rank is ``rank``, or the smallest k keeping ``energy`` of the squared singular values (the
squared Frobenius norm), capped by ``rank`` when both are given -- and never above the update's
numerical rank (singular values at float32 rounding level are noise, not signal). The relative error
``||delta - B @ A||_F / ||delta||_F`` follows from the dropped singular values. Factoring runs on the
GPU when ``torch.cuda.is_available()`` (or on ``device``), else on the CPU; results come back on the CPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from merge_engine.errors import InvalidOption


@dataclass(frozen=True)
class ModuleReport:
    """How well a module's update is kept: the rank used and the relative Frobenius error."""

    module: str
    rank: int
    relative_error: float


@dataclass(frozen=True, eq=False)
class Factors:
    a: torch.Tensor  # (k, in)
    b: torch.Tensor  # (out, k)
    rank: int
    relative_error: float


def svd_device(device: str | None = None) -> torch.device:
    if device:
        return torch.device(device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def check_targets(rank: int | None, energy: float | None) -> None:
    if rank is None and energy is None:
        raise InvalidOption("give --rank or --energy (or both: the energy's rank, capped by --rank)")
    if rank is not None and rank < 1:
        raise InvalidOption(f"--rank must be at least 1, got {rank}")
    if energy is not None and not 0.0 < energy <= 1.0:
        raise InvalidOption(f"--energy is a fraction in (0, 1], got {energy}")


def numerical_rank(singular_values: torch.Tensor, shape: tuple[int, int]) -> int:
    """Singular values above float32 noise (``s_max * max(shape) * eps``, as matrix_rank)."""
    if not singular_values.numel():
        return 0
    floor = float(singular_values.max()) * max(shape) * torch.finfo(torch.float32).eps
    return int((singular_values > floor).sum())


def choose_rank(singular_values: torch.Tensor, rank: int | None, energy: float | None,
                shape: tuple[int, int] | None = None) -> int:
    """The rank to keep: ``rank`` / ``energy`` as the module docstring says, never above the
    numerical rank of a ``shape`` matrix (no factors of pure rounding noise); at least 1."""
    s2 = singular_values.to(torch.float64) ** 2
    total = float(s2.sum())
    k = s2.numel() if shape is None else numerical_rank(singular_values, shape)
    if energy is not None and total > 0:
        kept = torch.cumsum(s2, 0) / total
        k = min(k, int(torch.searchsorted(kept, torch.tensor(energy, dtype=torch.float64) - 1e-12)) + 1)
    if rank is not None:
        k = min(k, rank)
    return max(1, min(k, s2.numel()))


def relative_error(singular_values: torch.Tensor, k: int) -> float:
    s2 = singular_values.to(torch.float64) ** 2
    total = float(s2.sum())
    return math.sqrt(float(s2[k:].sum()) / total) if total > 0 else 0.0


def factor_dense(delta: torch.Tensor, *, rank: int | None, energy: float | None,
                 device: torch.device | None = None) -> Factors:
    """Thin SVD of a dense update (float32 on ``device``)."""
    device = device or svd_device()
    u, s, vh = torch.linalg.svd(delta.to(device=device, dtype=torch.float32), full_matrices=False)
    k = choose_rank(s, rank, energy, tuple(delta.shape))
    b = (u[:, :k] * s[:k]).cpu()
    a = vh[:k].cpu()
    return Factors(a.contiguous(), b.contiguous(), k, relative_error(s.cpu(), k))


def factor_product(b: torch.Tensor, a: torch.Tensor, *, rank: int | None, energy: float | None,
                   device: torch.device | None = None) -> Factors:
    """SVD of ``b @ a`` (b: out x R, a: R x in) through the QR of each factor, in float64."""
    device = device or svd_device()
    b64 = b.to(device=device, dtype=torch.float64)
    a64 = a.to(device=device, dtype=torch.float64)
    qb, rb = torch.linalg.qr(b64)  # b = qb @ rb
    qa, ra = torch.linalg.qr(a64.T)  # a = ra.T @ qa.T
    u, s, vh = torch.linalg.svd(rb @ ra.T, full_matrices=False)
    k = choose_rank(s, rank, energy, (b.shape[0], a.shape[1]))
    new_b = (qb @ u[:, :k]) * s[:k]
    new_a = vh[:k] @ qa.T
    return Factors(new_a.to(torch.float32).cpu().contiguous(), new_b.to(torch.float32).cpu().contiguous(), k,
                   relative_error(s.cpu(), k))
