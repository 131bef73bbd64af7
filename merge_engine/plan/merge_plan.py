"""MergePlan, the record every planner returns: every output tensor (name, shape, dtype, how to
build it) and its shard file, decided from metadata alone before any weight is read.

A `PlannedTensor` either copies one source tensor (``build is None``: streamed chunk by chunk,
cast to the output dtype) or names a `TensorBuilder` — a small object that computes the output
from one or more source tensors (Megatron QKV splits, LoRA fusion, ...). Shards are filled
greedily in plan order up to ``max_shard_size`` bytes, like ``save_pretrained``. The planners
(`merge_engine.planner` picks one) build it, each tensor in its stored dtype; `MergePlan.with_dtype` applies ``--dtype`` (`output_dtype`: floating
point only); writers and jobs consume it. Also here: the size option every planner reads.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import torch

from merge_engine.errors import UnsupportedLayout
from merge_engine.formats.hf_metadata import INDEX_FILE, SINGLE_FILE
from merge_engine.option_values import DEFAULT_MAX_SHARD_SIZE, parse_size
from merge_engine.formats.safetensors_file import CODES
from merge_engine.formats.tensor_source import TensorSource

__all__ = ["DEFAULT_MAX_SHARD_SIZE", "INDEX_FILE", "SINGLE_FILE", "MergePlan", "PlannedTensor",
           "RangedTensorBuilder", "ShardFile", "TensorBuilder", "assign_shards", "output_dtype", "parse_size",
           "stored_dtype_update"]


def output_dtype(stored: torch.dtype, requested: torch.dtype | None) -> torch.dtype:
    """``--dtype`` casts floating-point tensors only (as save_pretrained does): integer and bool
    buffers keep their dtype, or a cast would change their values."""
    return requested if requested is not None and stored.is_floating_point else stored


class TensorBuilder(Protocol):
    """Computes one output tensor from source tensors; yields flat chunks in row-major order."""

    @property
    def inputs(self) -> tuple[str, ...]:
        """The source tensors it reads."""

    def chunks(self, source: TensorSource, max_bytes: int) -> Iterator[torch.Tensor]: ...


class RangedTensorBuilder(TensorBuilder, Protocol):
    """A builder that can also start inside its output (a byte range of a file cut through the tensor)."""

    def chunks_range(self, source: TensorSource, start: int, count: int, max_bytes: int) -> Iterator[torch.Tensor]:
        ...


@dataclass(frozen=True)
class PlannedTensor:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    source_name: str
    build: TensorBuilder | None = None  # None: copy ``source_name``

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class ShardFile:
    filename: str
    tensors: tuple[str, ...]
    size: int  # bytes of tensor data (header excluded)


@dataclass(frozen=True)
class MergePlan:
    tensors: tuple[PlannedTensor, ...]
    shards: tuple[ShardFile, ...]
    config_updates: dict[str, Any] = field(default_factory=dict, hash=False)
    notes: tuple[str, ...] = ()
    # the keys config_updates adds for transformers 4.x readers (`merge_engine.plan.hub_config.ConfigChange`)
    config_changes: tuple[Any, ...] = field(default=(), hash=False)
    records: dict[str, Any] = field(default_factory=dict, hash=False)  # what stepmerge.json records of the plan

    @property
    def total_size(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def by_name(self) -> dict[str, PlannedTensor]:
        return {t.name: t for t in self.tensors}

    def with_dtype(self, dtype: torch.dtype | None) -> MergePlan:
        """This plan written in ``dtype`` (``--dtype``, the one place an output dtype is applied).

        Args:
            dtype: the output dtype of floating-point tensors (`output_dtype`); None keeps every tensor's
                stored dtype.

        Returns:
            The plan with each floating-point `PlannedTensor.dtype` cast and ``config.json``'s ``dtype`` key set
            to ``dtype`` (`stored_dtype_update`); the plan itself when ``dtype`` is None.

        Raises:
            ValueError: the plan is already sharded (a cast changes tensor sizes: every command casts the
                planner's unsharded plan, then `merge_engine.plan.hub_format.in_weights_format` shards it).
        """
        if dtype is None:
            return self
        if self.shards:
            raise ValueError("with_dtype changes tensor sizes: cast a plan before it is sharded")
        tensors = tuple(replace(t, dtype=output_dtype(t.dtype, dtype)) for t in self.tensors)
        return replace(self, tensors=tensors,
                       config_updates={**self.config_updates, **stored_dtype_update(tensors, dtype)})


def assign_shards(tensors: Sequence[PlannedTensor], max_shard_size: int | None) -> tuple[ShardFile, ...]:
    """Greedy, in order: a shard closes when the next tensor would push it past the limit.

    Every plan ends here, in its output dtypes, before any byte is written: a dtype safetensors cannot store
    (complex, some float8 kinds) is refused then with `UnsupportedLayout` naming the tensor, not halfway through a
    write. ``max_shard_size`` None: neither sharded nor checked (a planner's plan, in its stored dtypes: the caller
    casts it, `MergePlan.with_dtype`, then shards it once after the Hub's naming,
    `merge_engine.plan.hub_format.in_weights_format`).
    """
    if max_shard_size is None:
        return ()
    for tensor in tensors:
        if tensor.dtype not in CODES:
            raise UnsupportedLayout(f"{tensor.name}: dtype {tensor.dtype} cannot be stored in safetensors "
                                    "(cast it with --dtype if it is floating point, or drop it)")
    groups: list[list[PlannedTensor]] = []
    size = 0
    for tensor in tensors:
        if not groups or (groups[-1] and size + tensor.nbytes > max_shard_size):
            groups.append([])
            size = 0
        groups[-1].append(tensor)
        size += tensor.nbytes
    if len(groups) <= 1:
        names = [SINGLE_FILE]
    else:
        names = [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    return tuple(ShardFile(name, tuple(t.name for t in g), sum(t.nbytes for t in g)) for name, g in zip(names, groups))


def stored_dtype_update(tensors: Sequence[PlannedTensor], dtype: torch.dtype | None) -> dict[str, str]:
    """The ``config.json`` ``dtype`` of an output: ``dtype`` when given, else the one floating-point
    dtype the planned tensors share (nothing when they mix several)."""
    if dtype is not None:
        return {"dtype": str(dtype).removeprefix("torch.")}
    stored = {t.dtype for t in tensors if t.dtype.is_floating_point}
    return {"dtype": str(stored.pop()).removeprefix("torch.")} if len(stored) == 1 else {}
