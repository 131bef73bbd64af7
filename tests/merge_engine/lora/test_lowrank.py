"""The randomized SVD of updates (`merge_engine.lora.lowrank`, `merge_engine.lora.svd.factor_dense_batch`).

What it must give, checked against the full ``torch.linalg.svd`` of the same matrices: the same rank, a
relative error within 1e-3 of the full SVD's truncation error, and a reported error that IS the error of
the factors returned (measured on them here). Matrices: fine-tuning updates of known rank plus noise, a
slowly decaying spectrum, and plain Gaussian ones (a flat spectrum: the worst case for power iterations).
"""

from __future__ import annotations

import math

import pytest
import torch

from merge_engine.lora import lowrank
from merge_engine.lora.svd import FULL, RANDOMIZED, factor_dense_batch, sketch_size
from tests.merge_engine.lora.dense_factors import factor_dense

SHAPES = ((1024, 320), (320, 1024))


def finetune_update(shape: tuple[int, int], rank: int, noise: float, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    m, n = shape
    low = torch.randn(m, rank, generator=generator) @ torch.randn(rank, n, generator=generator) / math.sqrt(n)
    return low * 0.02 + noise * torch.randn(m, n, generator=generator) / math.sqrt(n)


def decaying(shape: tuple[int, int], seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    m, n = shape
    u = torch.linalg.qr(torch.randn(m, min(m, n), generator=generator)).Q
    v = torch.linalg.qr(torch.randn(n, min(m, n), generator=generator)).Q
    return (u * 0.97 ** torch.arange(min(m, n), dtype=torch.float32)) @ v.T


def gaussian(shape: tuple[int, int], seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def full_error(delta: torch.Tensor, k: int) -> float:
    s = torch.linalg.svdvals(delta.double())
    return math.sqrt(float((s[k:] ** 2).sum() / (s ** 2).sum()))


def measured_error(delta: torch.Tensor, factors) -> float:
    return float(torch.linalg.norm(delta.double() - factors.b.double() @ factors.a.double())
                 / torch.linalg.norm(delta.double()))


CASES = {
    "finetune rank 4 + noise": lambda shape: finetune_update(shape, 4, 1e-3, 1),
    "finetune rank 12 + noise": lambda shape: finetune_update(shape, 12, 1e-2, 2),
    "decaying spectrum": lambda shape: decaying(shape, 3),
    "gaussian": lambda shape: gaussian(shape, 4),
}


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("case", sorted(CASES))
def test_randomized_errors_are_the_full_svds_within_1e_3(case, shape):
    """rank 8: the randomized factors keep the full SVD's rank and its truncation error within 1e-3; the
    reported error is the factors' own error."""
    delta = CASES[case](shape)
    factors = factor_dense(delta, rank=8, energy=None, device=torch.device("cpu"))
    full = factor_dense(delta, rank=8, energy=None, device=torch.device("cpu"), method=FULL)
    assert factors.method == RANDOMIZED and full.method == FULL
    assert factors.rank == full.rank == 8  # noise lifts every update to full numerical rank
    assert abs(factors.relative_error - full_error(delta, factors.rank)) <= 1e-3
    assert abs(full.relative_error - full_error(delta, full.rank)) <= 1e-6
    assert factors.relative_error == pytest.approx(measured_error(delta, factors), abs=1e-6)
    assert factors.a.shape == (factors.rank, shape[1]) and factors.b.shape == (shape[0], factors.rank)


def test_an_update_of_lower_rank_keeps_its_own_rank_exactly():
    """No factors of rounding noise: a rank-3 update asked at rank 8 comes back at rank 3, error ~0."""
    delta = finetune_update((1024, 384), 3, 0.0, 5)
    factors = factor_dense(delta, rank=8, energy=None, device=torch.device("cpu"))
    assert factors.method == RANDOMIZED and factors.rank == 3 and factors.relative_error < 1e-5


def test_energy_with_a_rank_cap_uses_the_sketch_and_energy_alone_the_whole_spectrum():
    delta = decaying((1024, 384), 6)
    capped = factor_dense(delta, rank=16, energy=0.5, device=torch.device("cpu"))
    full_capped = factor_dense(delta, rank=16, energy=0.5, device=torch.device("cpu"), method=FULL)
    assert capped.method == RANDOMIZED and capped.rank == full_capped.rank < 16
    assert abs(capped.relative_error - full_capped.relative_error) <= 1e-3
    alone = factor_dense(delta, rank=None, energy=0.5, device=torch.device("cpu"))
    assert alone.method == FULL and alone.rank == full_capped.rank
    assert sketch_size((1024, 384), None, 0.5) is None and sketch_size((64, 64), 8, None) is None


def test_results_are_deterministic_and_do_not_depend_on_the_batch():
    """One seeded sketch per shape: the same matrix gives the same factors run after run, alone or batched."""
    deltas = torch.stack([finetune_update((768, 256), 6, 1e-3, seed) for seed in (10, 11, 12)])
    first = factor_dense_batch(deltas, rank=8, energy=None)
    again = factor_dense_batch(deltas.clone(), rank=8, energy=None)
    alone = factor_dense(deltas[1], rank=8, energy=None, device=torch.device("cpu"))
    assert all(torch.equal(x.a, y.a) and torch.equal(x.b, y.b) for x, y in zip(first, again))
    assert first[1].rank == alone.rank
    torch.testing.assert_close(first[1].b @ first[1].a, alone.b @ alone.a, atol=1e-6, rtol=1e-4)


def test_a_failed_check_falls_back_to_the_full_svd(monkeypatch):
    """A tolerance no iteration can meet leaves every matrix untrusted: each is factored by the full SVD."""
    deltas = torch.stack([gaussian((768, 256), 20), finetune_update((768, 256), 4, 1e-3, 21)])
    unchecked = lowrank.lowrank_svd(deltas, lambda i, s: 8, 18, tol=-1.0, max_extra=1)
    assert unchecked.trusted == (False, False) and unchecked.iterations == lowrank.NITER + 2
    monkeypatch.setattr(lowrank, "TOL", -1.0)
    factors = factor_dense_batch(deltas, rank=8, energy=None)
    assert [f.method for f in factors] == [FULL, FULL]
    assert factors[0].relative_error == pytest.approx(full_error(deltas[0], 8), abs=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_on_the_gpu_the_factors_are_the_cpus():
    """The same sketch on every device: on cuda, the ranks are the CPU's and the errors equal within 1e-3."""
    deltas = torch.stack([finetune_update((1024, 320), 6, 1e-3, 30), gaussian((1024, 320), 31)])
    on_cpu = factor_dense_batch(deltas, rank=8, energy=None)
    on_gpu = factor_dense_batch(deltas.cuda(), rank=8, energy=None)
    for cpu, gpu in zip(on_cpu, on_gpu):
        assert gpu.a.device.type == "cpu" and gpu.rank == cpu.rank and gpu.method == RANDOMIZED
        assert abs(gpu.relative_error - cpu.relative_error) <= 1e-3
