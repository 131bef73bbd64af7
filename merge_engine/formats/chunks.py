"""Flat chunk streams: one tensor cut into bounded flat pieces, and streams cut differently re-cut together.

Tensors travel between sources, builders and the writer as streams of flat (1-D) chunks of at
most ``max_bytes`` each; two streams of the same tensor length are usually cut at different places
(shard borders, row runs, chunk sizes). Contracts:

- `flat_slices(tensor, max_bytes)`: views of the flattened tensor, in order, each of at most
  ``max_bytes`` (at least one element); nothing for an empty tensor. No copy when the tensor is
  contiguous.
- `aligned_chunks(*streams)`: tuples of equal-length pieces (views), one per stream, in order:
  element ``i`` of every stream arrives in the same tuple. All streams must end together; one that
  ends early (or late) raises ``error(message)`` (`ValueError` unless the caller names its own).
  Memory: one chunk of each stream.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import torch


def flat_slices(tensor: torch.Tensor, max_bytes: int) -> Iterator[torch.Tensor]:
    """The flattened ``tensor`` in consecutive views of at most ``max_bytes`` (one element at least)."""
    flat = tensor.reshape(-1)
    step = max(1, max_bytes // max(flat.element_size(), 1))
    for start in range(0, flat.numel(), step):
        yield flat[start:start + step]


def aligned_chunks(*streams: Iterable[torch.Tensor], error: Callable[[str], Exception] = ValueError
                   ) -> Iterator[tuple[torch.Tensor, ...]]:
    """Re-cut flat chunk streams of equal total length into tuples of equal-length pieces."""
    iterators = [iter(s) for s in streams]
    current: list[torch.Tensor | None] = [None] * len(iterators)
    while True:
        for i, iterator in enumerate(iterators):
            while (chunk := current[i]) is None or not chunk.numel():
                current[i] = next(iterator, None)
                if current[i] is None:
                    break
        ended = [i for i, c in enumerate(current) if c is None]
        if ended:
            if len(ended) < len(current):
                raise error(f"chunk streams differ in length: stream {ended[0]} ended before the others")
            return
        pieces = [c for c in current if c is not None]  # all of them: none ended
        n = min(c.numel() for c in pieces)
        yield tuple(c[:n] for c in pieces)
        current = [c[n:] for c in pieces]


__all__ = ["aligned_chunks", "flat_slices"]
