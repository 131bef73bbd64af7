"""Randomized low-rank SVD of a batch of same-shape matrices, checked against its own residual.

`lowrank_svd(d, keep, ...)`: ``d`` is (b, m, n) float32 on any device. A sketch ``d @ omega`` (omega:
n x q Gaussian, q = keep + oversampling, drawn from a CPU generator seeded with ``seed`` and shared by
every matrix of the shape: the same input gives the same factors in any batch, on any device) is
refined by ``niter`` power iterations (a QR after each product keeps the basis orthonormal), then the
SVD of the small (q x n) projection gives ``u``, ``s``, ``vh``. The rank-k factors ``u_k s_k vh_k`` are
the orthogonal projection of ``d`` onto ``span(u_k)``, so their residual is ``||d||^2 - sum(s_k^2)``.

The check, per matrix (`LowRank.trusted`): the residual ``||d - u_k s_k vh_k||_F`` is measured (not
derived), it must agree with the spectrum's ``||d||^2 - sum(s_k^2)``, and one more power iteration must
not lower it by more than ``tol`` (relative to ``||d||_F``): converged. Matrices that still gain after
``max_extra`` more iterations are left untrusted: the caller factors them with the full SVD.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

OVERSAMPLE = 10  # q = rank + OVERSAMPLE columns in the sketch
NITER = 2  # power iterations before the first check
MAX_EXTRA = 8  # further iterations while the residual still drops (a flat spectrum needs ~7)
TOL = 1e-4  # a drop of the relative residual below this is convergence
AGREE = 1e-4  # measured and spectral squared relative residuals must agree within this
SEED = 0


@dataclass(frozen=True, eq=False)
class LowRank:
    """The batch's top-q SVD estimates and, for the ranks kept, the measured relative residuals."""

    u: torch.Tensor  # (b, m, q)
    s: torch.Tensor  # (b, q)
    vh: torch.Tensor  # (b, q, n)
    kept: tuple[int, ...]  # the rank kept per matrix
    relative_error: tuple[float, ...]  # ||d - u_k s_k vh_k||_F / ||d||_F per matrix
    trusted: tuple[bool, ...]  # converged and consistent (else: use the full SVD)
    iterations: int


def sketch(n: int, q: int, device: torch.device, seed: int = SEED) -> torch.Tensor:
    """The (n, q) Gaussian test matrix: from a seeded CPU generator, so every device sees the same one."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(n, q, generator=generator, dtype=torch.float32).to(device)


def _orthonormal(y: torch.Tensor) -> torch.Tensor:
    return torch.linalg.qr(y, mode="reduced").Q


def _power_step(d: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    return _orthonormal(d @ _orthonormal(d.mT @ q))


def _factors_in(d: torch.Tensor, basis: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """SVD of ``d`` restricted to ``span(basis)``. The (q x n) projection is wide, which LAPACK factors slowly:
    its transpose's QR first, then the SVD of the small (q x q) triangle."""
    q_right, r_right = torch.linalg.qr((basis.mT @ d).mT, mode="reduced")  # (basis^T d)^T = q_right r_right
    u_small, s, vh_small = torch.linalg.svd(r_right.mT)
    return basis @ u_small, s, vh_small @ q_right.mT


def squared_norms(x: torch.Tensor) -> torch.Tensor:
    """``||x_i||_F^2`` of each matrix of (b, m, n) ``x`` as float64 on the CPU: float32 row norms (fast on every
    device), summed in float64 (a float32 norm of the whole matrix drifts by ~1e-3 on the CPU)."""
    return torch.linalg.vector_norm(x, dim=-1).double().pow(2).sum(dim=-1).cpu()


def _residuals(d: torch.Tensor, u: torch.Tensor, s: torch.Tensor, vh: torch.Tensor, kept: list[int],
               norms2: torch.Tensor) -> tuple[list[float], list[float]]:
    """(measured, spectral) squared relative residuals of the rank-kept factors, per matrix."""
    mask = torch.arange(s.shape[-1], device=s.device)[None, :] < torch.tensor(kept, device=s.device)[:, None]
    kept_s = s * mask
    measured = squared_norms(d - (u * kept_s[:, None, :]) @ vh) / norms2
    captured = kept_s.double().pow(2).sum(dim=-1).cpu()
    spectral = (norms2 - captured).clamp(min=0.0) / norms2
    return measured.tolist(), spectral.tolist()


def lowrank_svd(d: torch.Tensor, keep: Callable[[int, torch.Tensor], int], q: int, *, niter: int = NITER,
                max_extra: int = MAX_EXTRA, tol: float = TOL, seed: int = SEED) -> LowRank:
    """Randomized SVD of each (m, n) matrix of ``d`` (b, m, n; float32, none all zero) with a q-column sketch;
    ``keep(i, s)`` gives the rank to keep of matrix i from its top-q singular values (descending, on the CPU).
    See the module docstring for the check; nothing here falls back by itself."""
    norms2 = squared_norms(d)
    basis = _orthonormal(d @ sketch(d.shape[-1], q, d.device, seed))
    for _ in range(niter):
        basis = _power_step(d, basis)
    u, s, vh = _factors_in(d, basis)
    s_cpu = s.cpu()
    kept = [keep(i, s_cpu[i]) for i in range(d.shape[0])]
    errors, spectral = _residuals(d, u, s, vh, kept, norms2)
    converged = [False] * d.shape[0]
    iterations = niter
    for _ in range(max_extra + 1):
        basis = _power_step(d, basis)
        iterations += 1
        u_new, s_new, vh_new = _factors_in(d, basis)
        s_new_cpu = s_new.cpu()
        kept_new = [keep(i, s_new_cpu[i]) for i in range(d.shape[0])]
        errors_new, spectral_new = _residuals(d, u_new, s_new, vh_new, kept_new, norms2)
        for i in range(d.shape[0]):
            if kept_new[i] == kept[i]:
                converged[i] = errors[i] ** 0.5 - errors_new[i] ** 0.5 <= tol
        u, s, vh, kept, errors, spectral = u_new, s_new, vh_new, kept_new, errors_new, spectral_new
        if all(converged):
            break
    trusted = tuple(c and abs(e - sp) <= AGREE for c, e, sp in zip(converged, errors, spectral))
    return LowRank(u, s, vh, tuple(kept), tuple(e ** 0.5 for e in errors), trusted, iterations)
