"""Low-rank factoring of weight updates: ``delta ~= B @ A`` with B (out, k), A (k, in).

- `factor_dense_batch(deltas, ...)`: dense updates (a full fine-tune minus its base) by a thin SVD.
- `factor_product(b, a, ...)`: an update already given as a product of thin factors (stacked
  adapters) -- QR of each factor, then the SVD of the small (R x R) core: exact, and it never forms
  the (out x in) matrix.
The rank is ``rank``, or the smallest k keeping ``energy`` of the squared singular values (the
squared Frobenius norm), capped by ``rank`` when both are given -- and never above the update's
numerical rank (singular values at float32 rounding level are noise, not signal). The relative error
``||delta - B @ A||_F / ||delta||_F`` is reported for each module.

`factor_dense_batch(deltas, ...)` factors a batch of same-shape updates on their device by one of two
methods (`Factors.method`): ``randomized`` (`merge_engine.lora.lowrank`: a sketch of rank + oversampling,
power iterations, the residual measured and checked for convergence) when a rank is given and the sketch
is small against the matrix; else, or for a matrix whose check fails, ``full`` (``torch.linalg.svd``:
the whole spectrum, which an ``energy`` threshold without a rank cap needs). Both keep the same rank;
their relative errors agree within 1e-3 (docs/gpu.md). Results come back on the CPU. The device is
`svd_device` (`merge_engine.devices.resolve_device`: cuda when available, a bad name is `InvalidDevice`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from merge_engine.devices import resolve_device
from merge_engine.errors import InvalidOption
from merge_engine.lora import lowrank

FULL, RANDOMIZED, AUTO = "full", "randomized", "auto"
METHODS = (AUTO, FULL, RANDOMIZED)


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
    method: str = FULL


def svd_device(device: str | None = None) -> torch.device:
    """The device SVD runs on: ``device`` checked (`merge_engine.devices.resolve_device`), cuda when None."""
    return resolve_device(device)


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
                shape: tuple[int, int] | None = None, total: float | None = None) -> int:
    """The rank to keep: ``rank`` / ``energy`` as the module docstring says, never above the
    numerical rank of a ``shape`` matrix (no factors of pure rounding noise); at least 1.
    ``total``: the squared Frobenius norm when ``singular_values`` are only the largest ones."""
    s2 = singular_values.to(torch.float64) ** 2
    total = float(s2.sum()) if total is None else total
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


def sketch_size(shape: tuple[int, int], rank: int | None, energy: float | None) -> int | None:
    """The randomized method's sketch width for a ``shape`` matrix, or None when the full SVD is the method:
    no rank (an energy threshold alone needs the whole spectrum), or a sketch not small against the matrix."""
    if rank is None:
        return None
    q = rank + lowrank.OVERSAMPLE
    return q if 4 * q <= min(shape) else None


def factor_dense_batch(deltas: torch.Tensor, *, rank: int | None, energy: float | None,
                       method: str = AUTO) -> list[Factors]:
    """Each (m, n) update of ``deltas`` (b, m, n; float32 on the device to compute on; none all zero) as
    `Factors` on the CPU, by ``method`` (``auto``: randomized where `sketch_size` allows, each matrix whose
    check fails by the full SVD)."""
    if method not in METHODS:
        raise InvalidOption(f"SVD method {method!r}: one of {', '.join(METHODS)}")
    shape = (int(deltas.shape[-2]), int(deltas.shape[-1]))
    q = sketch_size(shape, rank, energy) if method != FULL else None
    if method == RANDOMIZED and q is None:
        q = min(shape) if rank is None else min(rank + lowrank.OVERSAMPLE, min(shape))
    out: list[Factors | None] = [None] * deltas.shape[0]
    if q is not None:
        totals = lowrank.squared_norms(deltas)

        def keep(i: int, s: torch.Tensor) -> int:
            return choose_rank(s, rank, energy, shape, total=float(totals[i]))

        found = lowrank.lowrank_svd(deltas, keep, q, tol=lowrank.TOL)
        for i, k in enumerate(found.kept):
            if found.trusted[i] or method == RANDOMIZED:
                b = (found.u[i, :, :k] * found.s[i, :k]).cpu()
                a = found.vh[i, :k].cpu()
                out[i] = Factors(a.contiguous(), b.contiguous(), k, found.relative_error[i], RANDOMIZED)
    rest = [i for i, f in enumerate(out) if f is None]
    if rest:
        u, s, vh = torch.linalg.svd(deltas[rest], full_matrices=False)
        for j, i in enumerate(rest):
            s_cpu = s[j].cpu()
            k = choose_rank(s_cpu, rank, energy, shape)
            b = (u[j, :, :k] * s[j, :k]).cpu()
            a = vh[j, :k].cpu()
            out[i] = Factors(a.contiguous(), b.contiguous(), k, relative_error(s_cpu, k), FULL)
    return [f for f in out if f is not None]


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
