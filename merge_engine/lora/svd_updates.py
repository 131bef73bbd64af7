"""Factoring many modules' updates: reads overlapped with compute, same-shape updates batched on the device.

`factor_updates(modules, read_update, ...)`: a reader thread calls ``read_update(module)`` for each module in
order (the update as float32 on the CPU, or None when it is all zero) and hands it over through a queue of
`PREFETCH` updates, so the next tensors are read while the device factors; the main thread gathers updates
of one shape until they fill `batch_bytes` (`batch_budget`: more on a GPU), then factors the batch
(`merge_engine.lora.svd.factor_dense_batch`). Memory: the queue, plus at most one batch per shape.
Returns each module's `Factors` (None for an unchanged one) in module order; an error of the reader
(`AdapterError` for a non-finite update...) is raised here, and the reader stops when the caller fails.
The factors do not depend on how the updates were batched (one sketch per shape, seeded).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence

import torch

from merge_engine.lora.svd import AUTO, Factors, factor_dense_batch

PREFETCH = 2  # updates read ahead of the compute
CPU_BATCH_BYTES = 256 << 20
GPU_BATCH_BYTES = 2 << 30
_DONE = object()


def batch_budget(device: torch.device) -> int:
    """Bytes of updates factored at once: a GPU gains from large batches, a CPU only needs to stay busy."""
    return GPU_BATCH_BYTES if device.type == "cuda" else CPU_BATCH_BYTES


def factor_updates(modules: Sequence[str], read_update: Callable[[str], torch.Tensor | None], *,
                   rank: int | None, energy: float | None, device: torch.device, method: str = AUTO,
                   batch_bytes: int | None = None,
                   on_factors: Callable[[str, Factors | None], None] | None = None) -> dict[str, Factors | None]:
    """Every module's factors (see the module docstring); ``on_factors(module, factors)`` as each batch is done."""
    budget = batch_budget(device) if batch_bytes is None else batch_bytes
    handoff: queue.Queue = queue.Queue(maxsize=PREFETCH)
    stop = threading.Event()

    def put(item: object) -> bool:
        while not stop.is_set():
            try:
                handoff.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def reader() -> None:
        try:
            for module in modules:
                if stop.is_set() or not put((module, read_update(module))):
                    return
            put(_DONE)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller, raised there
            put(exc)

    results: dict[str, Factors | None] = {}
    pending: dict[tuple[int, ...], list[tuple[str, torch.Tensor]]] = {}

    def flush(shape: tuple[int, ...]) -> None:
        batch = pending.pop(shape)
        stacked = torch.stack([update for _, update in batch]).to(device)
        found = factor_dense_batch(stacked, rank=rank, energy=energy, method=method)
        del stacked
        for (module, _), factors in zip(batch, found):
            results[module] = factors
            if on_factors is not None:
                on_factors(module, factors)

    thread = threading.Thread(target=reader, name="svd-reader", daemon=True)
    thread.start()
    try:
        while True:
            item = handoff.get()
            if item is _DONE:
                break
            if isinstance(item, BaseException):
                raise item
            module, update = item
            if update is None:
                results[module] = None
                if on_factors is not None:
                    on_factors(module, None)
                continue
            shape = tuple(update.shape)
            pending.setdefault(shape, []).append((module, update))
            if sum(u.numel() * u.element_size() for _, u in pending[shape]) >= budget:
                flush(shape)
        for shape in list(pending):
            flush(shape)
    finally:
        stop.set()
        thread.join()
    return {module: results[module] for module in modules}
