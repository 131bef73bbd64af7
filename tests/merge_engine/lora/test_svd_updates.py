"""Factoring many updates (`merge_engine.lora.svd_updates.factor_updates`): reads overlapped with the
compute by a reader thread, same-shape updates batched, results in module order whatever the batching."""

from __future__ import annotations

import threading

import pytest
import torch

from merge_engine.lora.svd_updates import factor_updates
from merge_engine.errors import AdapterError
from tests.merge_engine.lora.dense_factors import factor_dense

CPU = torch.device("cpu")


def update(shape: tuple[int, int], seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    low = torch.randn(shape[0], 5, generator=generator) @ torch.randn(5, shape[1], generator=generator)
    return low + 1e-3 * torch.randn(*shape, generator=generator)


MODULES = {f"layers.{i}.{name}": shape for i in range(3)
           for name, shape in (("q", (256, 256)), ("up", (512, 256)), ("down", (256, 512)))}


def test_batched_factors_equal_one_at_a_time_and_come_back_in_module_order():
    """Small batches, large batches and one update at a time give the same factors; an all-zero update is None."""
    updates = {m: update(shape, i) for i, (m, shape) in enumerate(MODULES.items())}
    updates["layers.1.q"] = None
    readers: set[str] = set()

    def read(module: str) -> torch.Tensor | None:
        readers.add(threading.current_thread().name)
        return updates[module]

    batched = factor_updates(list(MODULES), read, rank=8, energy=None, device=CPU, batch_bytes=1 << 30)
    single = factor_updates(list(MODULES), read, rank=8, energy=None, device=CPU, batch_bytes=0)
    assert list(batched) == list(MODULES) and batched["layers.1.q"] is None
    assert readers == {"svd-reader"}  # the reads ran beside the compute, not in the caller's thread
    for module, factors in batched.items():
        if factors is None:
            continue
        alone = factor_dense(updates[module], rank=8, energy=None, device=CPU)
        assert factors.rank == single[module].rank == alone.rank == 8 and factors.method == "randomized"
        torch.testing.assert_close(factors.b @ factors.a, alone.b @ alone.a, atol=1e-5, rtol=1e-4)
        assert factors.relative_error == pytest.approx(alone.relative_error, abs=1e-6)


def test_a_reader_error_is_raised_to_the_caller_and_the_reader_stops():
    seen = []

    def read(module: str) -> torch.Tensor:
        seen.append(module)
        if module == "layers.1.up":
            raise AdapterError("non-finite update", module)
        return update(MODULES[module], 0)

    with pytest.raises(AdapterError, match="non-finite"):
        factor_updates(list(MODULES), read, rank=4, energy=None, device=CPU)
    assert "layers.2.down" not in seen and not any(t.name == "svd-reader" for t in threading.enumerate())
